"""What a source sees, as endpoints: the EndpointSlices of a Service, the pods of a selector
or the records of a DNS name, each engine once, with its phase and what its annotations say.
Objects are the API's JSON (dicts), read defensively: a field the API leaves out is absent."""

# baton: pure

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from baton.model import Backend
from control.backend_spec import make_backend
from control.discovery.settings import Engine, KubeSource

# The annotations an engine's pod (or the EndpointSlice, for a Service) may carry.
PREFIX = "baton.dev/"
MODEL, KIND = PREFIX + "model", PREFIX + "kind"
REASONING, TOOLS = PREFIX + "reasoning-parser", PREFIX + "tool-parser"
KV_PORT, KV_REPLAY_PORT = PREFIX + "kv-events-port", PREFIX + "kv-events-replay-port"
API_KEY_ENV = PREFIX + "api-key-env"


class Phase(StrEnum):
    READY = "ready"  # takes requests
    NOT_READY = "not-ready"  # alive, failing its readiness probe (or still starting)
    TERMINATING = "terminating"  # being deleted: its SIGTERM is coming


@dataclass(frozen=True, slots=True)
class Endpoint:
    id: str  # the backend's id: NAMESPACE/POD, or NAME/HOST:PORT for DNS
    host: str  # an address
    port: int
    phase: Phase
    annotations: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return f"http://{_bracketed(self.host)}:{self.port}"

    def said(self, key: str) -> str:
        return dict(self.annotations).get(key, "")


def from_slices(slices: Iterable[Mapping[str, Any]], source: KubeSource) -> dict[str, Endpoint]:
    """A Service's endpoints over all its EndpointSlices. An endpoint a rollout lists in two
    slices at once is taken at its most advanced phase (terminating over ready)."""
    out: dict[str, Endpoint] = {}
    for s in slices:
        if s.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue  # FQDN slices name no address control can reach by itself
        port = _slice_port(s.get("ports") or [], source.port)
        if port is None:
            continue
        notes = _notes(s.get("metadata") or {})
        for e in s.get("endpoints") or []:
            addresses = e.get("addresses") or []
            if not addresses:
                continue
            ref = e.get("targetRef") or {}
            name = ref.get("name") if ref.get("kind", "Pod") == "Pod" else None
            eid = f"{source.namespace}/{name or f'{addresses[0]}:{port}'}"
            one = Endpoint(eid, addresses[0], port, _slice_phase(e.get("conditions") or {}), notes)
            if eid not in out or _RANK[one.phase] > _RANK[out[eid].phase]:
                out[eid] = one
    return out


def from_pods(pods: Iterable[Mapping[str, Any]], source: KubeSource) -> dict[str, Endpoint]:
    out: dict[str, Endpoint] = {}
    for p in pods:
        meta, status = p.get("metadata") or {}, p.get("status") or {}
        ip = status.get("podIP")
        if not ip or status.get("phase") in ("Succeeded", "Failed"):
            continue  # not scheduled yet, or its containers are gone
        port = _pod_port(p.get("spec") or {}, source.port)
        if port is None:
            continue
        if meta.get("deletionTimestamp"):
            phase = Phase.TERMINATING
        else:
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in status.get("conditions") or [])  # fmt: skip
            phase = Phase.READY if ready else Phase.NOT_READY
        eid = f"{source.namespace}/{meta.get('name') or ip}"
        out[eid] = Endpoint(eid, ip, port, phase, _notes(meta))
    return out


def from_records(name: str, found: Iterable[tuple[str, int]]) -> dict[str, Endpoint]:
    """A DNS name's (address, port) pairs: each is ready while the name lists it."""
    return {f"{name}/{_bracketed(h)}:{p}": Endpoint(f"{name}/{_bracketed(h)}:{p}", h, p,
                                                    Phase.READY) for h, p in found}  # fmt: skip


def backend_for(e: Endpoint, model: str, engine: Engine) -> Backend:
    """The backend an endpoint is, its annotations over the source's defaults; a ConfigError
    names a bad annotation (the endpoint is then left out, not the source)."""
    kv, replay = e.said(KV_PORT), e.said(KV_REPLAY_PORT)
    host = _bracketed(e.host)
    return make_backend(
        id=e.id,
        url=e.url,
        model=model,
        kind=e.said(KIND) or engine.kind,
        reasoning_parser=e.said(REASONING) or engine.reasoning_parser,
        tool_parser=e.said(TOOLS) or engine.tool_parser,
        api_key_env=e.said(API_KEY_ENV),
        kv_events=f"tcp://{host}:{kv}" if kv else "",
        kv_events_replay=f"tcp://{host}:{replay}" if replay else "",
    )


_RANK = {Phase.NOT_READY: 0, Phase.READY: 1, Phase.TERMINATING: 2}


def _slice_phase(conditions: Mapping[str, Any]) -> Phase:
    # Kubernetes: an absent `ready` means ready; a terminating endpoint is never ready.
    if conditions.get("terminating") is True:
        return Phase.TERMINATING
    return Phase.NOT_READY if conditions.get("ready") is False else Phase.READY


def _slice_port(ports: Iterable[Mapping[str, Any]], want: int | str) -> int | None:
    for p in ports:
        if (p.get("protocol") or "TCP") != "TCP":
            continue
        if isinstance(want, str) and p.get("name") == want:
            return _int_port(p.get("port"))
        if isinstance(want, int) and p.get("port") == want:
            return want
    # A numbered port the slice does not list is still the engine's port on the pod.
    return want if isinstance(want, int) else None


def _pod_port(spec: Mapping[str, Any], want: int | str) -> int | None:
    if isinstance(want, int):
        return want
    for c in spec.get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == want:
                return _int_port(p.get("containerPort"))
    return None


def _int_port(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536 else None


def _notes(meta: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    notes = meta.get("annotations") or {}
    return tuple(sorted((k, str(v)) for k, v in notes.items() if k.startswith(PREFIX)))


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
