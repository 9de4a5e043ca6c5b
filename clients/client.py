"""Typed, synchronous client for control's AdminService (what the CLI and scripts use).
Errors come out as AdminError with a message a person can act on.

Control replicas (`--control A,B,C`, one of which leads): a call goes to the address that
answered last. A replica that does not lead refuses it unapplied (FAILED_PRECONDITION) and names
the leader (trailing metadata `baton-leader`): the call is made once more there, and that
address kept. An address that cannot be reached (UNAVAILABLE) gives way to the next. No other
failure is retried: the call may have been applied."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from baton import replicas, wire, wire_money
from baton.budgets import Budget
from baton.model import BackendKind, HealthState, Role
from baton.tenancy import KEY_ID_HEX, Limits, Priority
from baton.tokens import ADMIN_ENV
from baton.v1 import admin_pb2, admin_pb2_grpc, fleet_pb2

DEFAULT_CONTROL = "127.0.0.1:50051"
TOKEN_FILE = "admin-token"
SHIM_TOKEN_FILE = "shim-token"  # `baton up` writes it; a shim takes it with --shim-token-file


def find_token() -> str | None:
    """BATON_ADMIN_TOKEN, else the token file `baton up` wrote ($BATON_DATA_DIR or ./.baton)."""
    if os.environ.get(ADMIN_ENV):
        return os.environ[ADMIN_ENV]
    path = Path(os.environ.get("BATON_DATA_DIR") or ".baton") / TOKEN_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None




class AdminError(Exception):
    pass


def split_targets(text: str) -> tuple[str, ...]:
    """--control's addresses, as the shim reads its own (baton/replicas.py); AdminError when
    none is given."""
    try:
        return replicas.split_targets(text)
    except ValueError as exc:
        raise AdminError(f"--control: {exc}") from None


def _trailing(exc: grpc.RpcError) -> list[tuple[str, str | bytes]]:
    return [(m.key, m.value) for m in exc.trailing_metadata() or ()]


def leader_named(exc: grpc.RpcError) -> str:
    """The leader's address a replica's FAILED_PRECONDITION names ("" for any other error,
    or a refusal that names none)."""
    if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
        return ""
    return replicas.leader_in(_trailing(exc))


@dataclass(frozen=True, slots=True)
class BackendRow:
    id: str
    url: str
    model: str
    kind: str
    role: str
    state: str
    reason: str
    since: str  # ISO 8601, UTC
    in_flight: int
    migrating: bool = False  # drained with --migrate: in-flight streams move elsewhere
    reasoning_parser: str = ""  # the engine's --reasoning-parser; "" = none
    tool_parser: str = ""  # the engine's --tool-call-parser; "" = none
    # Where control reads the engine's KV-cache events (ZMQ) and its replay socket; "" = none.
    kv_events: str = ""
    kv_events_replay: str = ""
    data_parallel_rank: int | None = None  # one rank of a data-parallel vLLM; None = whole
    # The engine's own gauges at control's last reading: "running+waiting kv N%", or "-".
    engine: str = "-"
    engine_age_s: float | None = None
    # Its KV-cache index (from the engine's KV events): off, live, replaying or lost.
    kv_index: str = "off"
    kv_blocks: int = 0
    kv_reason: str = ""
    # LoRA adapters it holds as control knows them, and how many it may hold (0: not an
    # adapter engine, or not read yet).
    adapters: tuple[str, ...] = ()
    max_adapters: int = 0
    # "config", "cli", or the discovery source that found it ("k8s:NS/SERVICE", "dns:NAME").
    source: str = ""


def _iso(ts: Timestamp) -> str:
    return datetime.fromtimestamp(ts.ToNanoseconds() / 1e9, UTC).isoformat(timespec="seconds")




def _pair_state(pb: int) -> str:
    state = wire.PAIR_STATE_FROM_PB.get(pb)  # type: ignore[call-overload]
    return state.value if state is not None else "unknown"


def _pair(p: fleet_pb2.Pair) -> dict[str, Any]:
    return {
        "id": p.id,
        "model": p.model,
        "draft": p.draft_backend_id,
        "target": p.target_backend_id,
        "bound_target": p.bound_target_backend_id,
        "k": p.num_draft_tokens,
        "state": _pair_state(p.state),
        "baseline": round(p.baseline_acceptance, 3),
        "acceptance": round(p.recent_acceptance, 3),
        "rounds": p.rounds,
        "params_hash": p.params_hash.removeprefix("sha256:")[:12],
        "reason": p.reason,
    }


def _tenant(t: fleet_pb2.Tenant) -> dict[str, Any]:
    """A tenant as the CLI shows it: its keys by key id and creation time, never a digest in
    full (and control never sends a key but once, at its making)."""
    lim = wire.limits_from_pb(t.limits)
    priority = wire.PRIORITY_FROM_PB.get(t.priority)
    return {
        "id": t.id,
        "priority": priority.value if priority is not None else "unknown",
        "weight": t.weight,
        "limits": {**dict(lim.rates()), "models": sorted(lim.models)},
        "keys": [
            # A key from the config file (given by digest) has no creation time.
            {"key_id": k.key_id or k.digest.hex()[:KEY_ID_HEX],
             "created": _iso(k.created) if k.created.ToNanoseconds() else None}
            for k in t.keys
        ],
        "budgets": [b.text() for b in wire_money.budgets_from_pb(t.budgets, t.id)],
    }  # fmt: skip


def _usage(u: admin_pb2.TenantUsage) -> dict[str, Any]:
    return {
        "tenant": u.tenant_id,
        "requests": u.requests,
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "refused": dict(sorted(u.refused.items())),
        "in_flight": u.in_flight,
        "queued_seconds": round(u.queued_seconds, 3),
        "cost": u.cost or "0",
        "budgets": [_standing(s) for s in u.budgets],
    }


def _price(p: admin_pb2.ModelPrice) -> dict[str, Any]:
    return {"model": p.model, "input": p.price.input, "cached_input": p.price.cached_input,
            "output": p.price.output}  # fmt: skip


def _standing(s: admin_pb2.BudgetStanding) -> dict[str, Any]:
    return {"budget": wire_money.budget_from_pb(s.budget).text(), "spent": s.spent,
            "in_flight": s.in_flight, "remaining": s.remaining,
            "resets": _iso(s.reset)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """What an operator configures of a tenant (its keys are control's to make)."""

    id: str
    priority: str = Priority.STANDARD.value
    weight: int = 1
    concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    models: tuple[str, ...] = ()
    budgets: tuple[Budget, ...] = ()

    @classmethod
    def of(cls, row: dict[str, Any]) -> TenantSpec:
        """The spec of a tenant as `tenants()` lists it."""
        lim = row["limits"]
        return cls(row["id"], row["priority"], row["weight"], lim["concurrent"],
                   lim["requests_per_minute"], lim["tokens_per_minute"],
                   tuple(lim["models"]),
                   tuple(Budget.parse(b) for b in row.get("budgets", ())))  # fmt: skip

    def to_pb(self) -> fleet_pb2.Tenant:
        try:
            priority = wire.PRIORITY_TO_PB[Priority(self.priority)]
            return fleet_pb2.Tenant(
                id=self.id,
                priority=priority,
                weight=self.weight,
                limits=wire.limits_to_pb(
                    Limits(self.concurrent, self.requests_per_minute, self.tokens_per_minute,
                           frozenset(self.models))  # fmt: skip
                ),
                budgets=[wire_money.budget_to_pb(b) for b in self.budgets],
            )
        except ValueError as exc:  # a priority not known, a number the wire cannot carry
            raise AdminError(f"tenant {self.id!r}: {exc}") from None


def _kv_state(pb: int) -> str:
    name: str = admin_pb2.KvIndexState.Name(pb)  # type: ignore[arg-type]
    return name.removeprefix("KV_INDEX_STATE_").lower()


def _row(s: fleet_pb2.BackendStatus, kv: admin_pb2.KvIndexStatus | None = None) -> BackendRow:
    b = s.backend
    return BackendRow(
        id=b.id,
        url=b.url,
        model=b.model,
        kind=wire.KIND_FROM_PB.get(b.kind, BackendKind.VLLM).value,
        role=wire.ROLE_FROM_PB.get(b.role, Role.SERVE).value,
        state=wire.STATE_FROM_PB.get(s.state, HealthState.DOWN).value,
        reason=s.reason,
        since=_iso(s.since),
        in_flight=s.in_flight,
        migrating=s.migrating,
        reasoning_parser=b.reasoning_parser,
        tool_parser=b.tool_parser,
        kv_events=b.kv_events,
        kv_events_replay=b.kv_events_replay,
        data_parallel_rank=b.data_parallel_rank if b.HasField("data_parallel_rank") else None,
        engine=_engine(s),
        engine_age_s=round(s.engine_age_s, 1) if s.engine_read else None,
        kv_index=_kv_state(kv.state) if kv is not None else "off",
        kv_blocks=kv.blocks if kv is not None else 0,
        kv_reason=kv.reason if kv is not None else "",
        adapters=tuple(s.adapters),
        max_adapters=s.max_adapters,
        source=s.source,
    )


def _engine(s: fleet_pb2.BackendStatus) -> str:
    if not s.engine_read:
        return "-"
    kv = f" kv {s.engine_kv_usage:.0%}" if s.engine_kv_usage >= 0 else ""
    return f"{s.engine_running:g}+{s.engine_waiting:g}{kv}"


def from_store(exc: grpc.RpcError) -> bool:
    """The leader answered, and its store (etcd) did not: the change was not made, and no
    other replica would make it either."""
    return replicas.from_store(_trailing(exc))


class AdminClient:
    def __init__(
        self,
        target: str = DEFAULT_CONTROL,
        *,
        token: str | None = None,
        timeout: float = 5.0,
        tls_ca: Path | None = None,
    ) -> None:
        """`target`: control's HOST:PORT, or its replicas' as A,B,C. `tls_ca`: PEM file of
        the CA that signed control's certificate; talk TLS."""
        self.targets = split_targets(target)
        self.target = self.targets[0]  # where calls go: the last address that answered
        self._ca: bytes | None = None
        if tls_ca is not None:
            try:
                self._ca = tls_ca.read_bytes()
            except OSError as exc:
                raise AdminError(f"--tls-ca: {exc}") from None
        self._tls = tls_ca is not None
        self._channels: dict[str, grpc.Channel] = {}  # opened when first called, then kept
        token = token if token is not None else find_token()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def _stub(self, target: str) -> admin_pb2_grpc.AdminServiceStub:
        if (channel := self._channels.get(target)) is None:
            if self._ca is not None:
                creds = grpc.ssl_channel_credentials(self._ca)
                channel = grpc.secure_channel(target, creds)
            else:
                channel = grpc.insecure_channel(target)
            self._channels[target] = channel
        return admin_pb2_grpc.AdminServiceStub(channel)

    def _again(self, exc: grpc.RpcError, tried: set[str], redirected: bool) -> str | None:
        """Where to make a call again that `exc` refused at self.target unapplied (None: it
        is not made again): the leader a replica named, unless the call was sent on to a
        leader already; else, when self.target could not be reached, the next address not
        tried yet."""
        leader = leader_named(exc)
        if leader:
            return None if redirected else leader
        if exc.code() is grpc.StatusCode.UNAVAILABLE and not from_store(exc):
            after = self.targets.index(self.target) + 1 if self.target in self.targets else 0
            for target in (*self.targets[after:], *self.targets[:after]):
                if target not in tried:
                    return target
        return None

    def _error(self, exc: grpc.RpcError) -> AdminError:
        code = exc.code()
        if from_store(exc):
            return AdminError(f"{code.name}: {exc.details()}")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            # A TLS/plaintext mismatch looks the same as nobody listening.
            tls = "with" if self._tls else "without"
            where = ",".join(self.targets) if len(self.targets) > 1 else self.target
            return AdminError(
                f"cannot reach the control plane at {where} ({code.name}); "
                f"is `baton control` running there, {tls} TLS (--tls-ca)?"
            )
        return AdminError(f"{code.name}: {exc.details()}")

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, method: str, request: object) -> object:
        tried: set[str] = set()
        redirected = False
        while True:
            tried.add(self.target)
            try:
                return getattr(self._stub(self.target), method)(
                    request, timeout=self._timeout, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                again = self._again(exc, tried, redirected)
                if again is None:
                    raise self._error(exc) from None
                redirected = redirected or bool(leader_named(exc))
                self.target = again

    def list_backends(self) -> list[BackendRow]:
        resp = self._call("ListBackends", admin_pb2.ListBackendsRequest())
        kv = resp.kv_index  # type: ignore[attr-defined]
        return [_row(s, kv.get(s.backend.id)) for s in resp.backends]  # type: ignore[attr-defined]

    def add_backend(
        self,
        id: str,
        url: str,
        model: str,
        kind: str = "vllm",
        role: str = "serve",
        api_key_env: str = "",
        reasoning_parser: str = "",
        tool_parser: str = "",
        kv_events: str = "",
        kv_events_replay: str = "",
        data_parallel_rank: int | None = None,
    ) -> BackendRow:
        try:
            pb_kind = wire.KIND_TO_PB[BackendKind(kind)]
            pb_role = wire.ROLE_TO_PB[Role(role)]
        except ValueError as exc:
            raise AdminError(str(exc)) from None
        backend = fleet_pb2.Backend(
            id=id,
            url=url,
            model=model,
            kind=pb_kind,
            role=pb_role,
            api_key_env=api_key_env,
            reasoning_parser=reasoning_parser,
            tool_parser=tool_parser,
            kv_events=kv_events,
            kv_events_replay=kv_events_replay,
            data_parallel_rank=data_parallel_rank,
        )
        resp = self._call("AddBackend", admin_pb2.AddBackendRequest(backend=backend))
        return _row(resp.backend)  # type: ignore[attr-defined]

    def bind_pair(self, draft: str, target: str, num_draft_tokens: int = 0) -> dict[str, Any]:
        resp = self._call(
            "BindPair",
            admin_pb2.BindPairRequest(
                draft_backend_id=draft, target_backend_id=target, num_draft_tokens=num_draft_tokens
            ),
        )
        return _pair(resp.pair)  # type: ignore[attr-defined]

    def unbind_pair(self, id: str) -> None:
        self._call("UnbindPair", admin_pb2.UnbindPairRequest(id=id))

    def pairs(self) -> list[dict[str, Any]]:
        resp = self._call("ListPairs", admin_pb2.ListPairsRequest())
        return [_pair(p) for p in resp.pairs]  # type: ignore[attr-defined]

    def remove_backend(self, id: str) -> None:
        self._call("RemoveBackend", admin_pb2.RemoveBackendRequest(id=id))

    def drain_backend(self, id: str, migrate: bool = False) -> BackendRow:
        resp = self._call("DrainBackend", admin_pb2.DrainBackendRequest(id=id, migrate=migrate))
        return _row(resp.backend)  # type: ignore[attr-defined]

    def undrain_backend(self, id: str) -> BackendRow:
        resp = self._call("UndrainBackend", admin_pb2.UndrainBackendRequest(id=id))
        return _row(resp.backend)  # type: ignore[attr-defined]

    def status(self) -> dict[str, object]:
        resp: admin_pb2.GetStatusResponse = self._call(  # type: ignore[assignment]
            "GetStatus", admin_pb2.GetStatusRequest()
        )
        return {
            "control": self.target,
            "version": resp.version,
            "snapshot_version": resp.snapshot_version,
            "routing_policy": resp.routing_policy,
            "uptime_seconds": round(resp.uptime_seconds, 1),
            "in_flight": resp.in_flight,
            "models": [
                {"model": m.model, "backends": m.backends, "healthy": m.healthy}
                for m in resp.models
            ],
            # Control replicas (none for a single control): who answered, who leads, and
            # where the configuration is kept.
            "replica_id": resp.replica_id,
            "leader": resp.leader,
            "store": resp.store,
            "replicas": [
                {"id": r.id, "address": r.address, "role": "leader" if r.leader else "follower"}
                for r in resp.replicas
            ],
        }

    def events(
        self,
        *,
        kind: str = "",
        request_id: str = "",
        backend_id: str = "",
        since: float | None = None,
        limit: int = 1000,
    ) -> list[dict[str, Any]]:
        request = admin_pb2.ListEventsRequest(
            kind=kind, request_id=request_id, backend_id=backend_id, limit=limit
        )
        if since is not None:
            request.since.FromNanoseconds(int(since * 1e9))
        resp = self._call("ListEvents", request)
        return [json.loads(e.json) for e in resp.events]  # type: ignore[attr-defined]

    def pins(
        self, *, backend_id: str = "", limit: int = 100, kind: str = ""
    ) -> tuple[list[dict[str, Any]], int]:
        resp: admin_pb2.ListPinsResponse = self._call(  # type: ignore[assignment]
            "ListPins", admin_pb2.ListPinsRequest(backend_id=backend_id, limit=limit, kind=kind)
        )
        rows = [
            {
                "kind": p.kind or "prefix",
                # A prefix pin's chain hash (shortened), or the stored response's id.
                "key": p.key if p.kind in ("response", "session") else p.prefix.hex()[:16],
                "prefix": p.prefix.hex()[:16],
                "backend_id": p.backend_id,
                "depth": p.depth,
                "hits": p.hits,
                "created": _iso(p.created),
                "last_used": _iso(p.last_used),
            }
            for p in resp.pins
        ]
        return rows, resp.total

    def clear_pins(self, backend_id: str = "") -> int:
        resp: admin_pb2.ClearPinsResponse = self._call(  # type: ignore[assignment]
            "ClearPins", admin_pb2.ClearPinsRequest(backend_id=backend_id)
        )
        return resp.cleared

    def adapters(self) -> list[dict[str, Any]]:
        resp = self._call("ListAdapters", admin_pb2.ListAdaptersRequest())
        return [
            {"name": r.adapter.name, "base": r.adapter.base, "source": r.adapter.source,
             "declared": r.declared, "held_by": list(r.held_by),
             "loading_on": list(r.loading_on), "demand_rps": round(r.demand_rps, 3)}
            for r in resp.adapters  # type: ignore[attr-defined]
        ]  # fmt: skip

    def load_adapter(
        self, name: str, backend_id: str = "", base: str = "", source: str = ""
    ) -> dict[str, Any]:
        resp = self._call("LoadAdapter", admin_pb2.LoadAdapterRequest(
            name=name, backend_id=backend_id, base=base, source=source))  # fmt: skip
        return {"backend_id": resp.backend_id, "ok": resp.ok,  # type: ignore[attr-defined]
                "ms": round(resp.ms, 2), "detail": resp.detail,  # type: ignore[attr-defined]
                "evicted": list(resp.evicted)}  # type: ignore[attr-defined]  # fmt: skip

    def unload_adapter(self, name: str, backend_id: str = "") -> list[str]:
        resp = self._call("UnloadAdapter",
                          admin_pb2.UnloadAdapterRequest(name=name, backend_id=backend_id))
        return list(resp.unloaded_from)  # type: ignore[attr-defined]

    def tenants(self) -> list[dict[str, Any]]:
        resp = self._call("ListTenants", admin_pb2.ListTenantsRequest())
        return [_tenant(t) for t in resp.tenants]  # type: ignore[attr-defined]

    def add_tenant(self, spec: TenantSpec) -> tuple[dict[str, Any], str]:
        """(the tenant, its first key): the key is shown this once; control keeps its digest."""
        resp = self._call("AddTenant", admin_pb2.AddTenantRequest(tenant=spec.to_pb()))
        return _tenant(resp.tenant), resp.key  # type: ignore[attr-defined]

    def update_tenant(self, spec: TenantSpec) -> dict[str, Any]:
        """Replace the tenant's priority, weight and limits with the spec's (keys unchanged)."""
        resp = self._call("UpdateTenant", admin_pb2.UpdateTenantRequest(tenant=spec.to_pb()))
        return _tenant(resp.tenant)  # type: ignore[attr-defined]

    def remove_tenant(self, id: str) -> None:
        self._call("RemoveTenant", admin_pb2.RemoveTenantRequest(id=id))

    def add_tenant_key(self, id: str) -> tuple[dict[str, Any], str]:
        """(the tenant, its new key), the key shown this once; its other keys stay valid."""
        resp = self._call("AddTenantKey", admin_pb2.AddTenantKeyRequest(tenant_id=id))
        return _tenant(resp.tenant), resp.key  # type: ignore[attr-defined]

    def revoke_tenant_key(self, id: str, key_id: str) -> dict[str, Any]:
        resp = self._call(
            "RevokeTenantKey", admin_pb2.RevokeTenantKeyRequest(tenant_id=id, key_id=key_id)
        )
        return _tenant(resp.tenant)  # type: ignore[attr-defined]

    def tenant_usage(self, since: float | None = None) -> list[dict[str, Any]]:
        request = admin_pb2.TenantUsageRequest()
        if since is not None:
            request.since.FromNanoseconds(int(since * 1e9))
        resp = self._call("TenantUsage", request)
        # The fleet's models without a price (each costs 0): in every row, so a row says
        # whether its cost leaves something out.
        unpriced = list(resp.unpriced_models)  # type: ignore[attr-defined]
        return [{**_usage(u), "unpriced_models": unpriced}
                for u in resp.usage]  # type: ignore[attr-defined]  # fmt: skip

    def prices(self) -> dict[str, Any]:
        """{"prices": [{model, input, cached_input, output}], "unpriced_models": [...]}:
        per million tokens, as exact decimal strings."""
        resp: admin_pb2.ListPricesResponse = self._call(  # type: ignore[assignment]
            "ListPrices", admin_pb2.ListPricesRequest())
        return {"prices": [_price(p) for p in resp.prices],
                "unpriced_models": list(resp.unpriced_models)}  # fmt: skip

    def set_price(
        self, model: str, input: str, output: str, cached_input: str = ""
    ) -> dict[str, Any]:
        price = fleet_pb2.Price(input=input, output=output, cached_input=cached_input)
        resp: admin_pb2.SetPriceResponse = self._call(  # type: ignore[assignment]
            "SetPrice", admin_pb2.SetPriceRequest(model=model, price=price))
        return _price(resp.price)

    def unset_price(self, model: str) -> None:
        self._call("UnsetPrice", admin_pb2.UnsetPriceRequest(model=model))

    def usage_days(
        self, since: float | None = None, until: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """Use per tenant, model and UTC day over the days that overlap [since, until), page
        by page, in (day, tenant, model) order; cost a decimal string."""
        request = admin_pb2.ExportUsageRequest()
        if since is not None:
            request.since.FromNanoseconds(int(since * 1e9))
        if until is not None:
            request.until.FromNanoseconds(int(until * 1e9))
        while True:
            resp: Any = self._call("ExportUsage", request)
            for r in resp.rows:
                yield {"day": r.day, "tenant": r.tenant_id, "model": r.model,
                       "requests": r.requests, "prompt_tokens": r.prompt_tokens,
                       "cached_tokens": r.cached_tokens,
                       "completion_tokens": r.completion_tokens, "cost": r.cost}  # fmt: skip
            if not resp.next_page_token:
                return
            request.page_token = resp.next_page_token

    def follow(
        self, *, kind: str = "", request_id: str = "", backend_id: str = ""
    ) -> Iterator[dict[str, Any]]:
        """New events as they happen, until the caller stops iterating."""
        request = admin_pb2.WatchEventsRequest(
            kind=kind, request_id=request_id, backend_id=backend_id
        )
        tried: set[str] = set()
        redirected = seen = False
        while True:
            tried.add(self.target)
            try:
                for resp in self._stub(self.target).WatchEvents(request, metadata=self._metadata):
                    seen = True
                    yield json.loads(resp.event.json)
                return
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.CANCELLED:
                    return
                # Once events have come, the stream is not started again elsewhere: the
                # events between would be missed without a word.
                again = None if seen else self._again(exc, tried, redirected)
                if again is None:
                    raise AdminError(f"{exc.code().name}: {exc.details()}") from None
                redirected = redirected or bool(leader_named(exc))
                self.target = again
