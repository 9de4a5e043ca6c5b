"""The router's step for a request that names a LoRA adapter (issue 42): where it may go, the
loads it starts, and the requests that wait for one.

`steer` places the request (control/routing/adapters.py over the book's residency, demand and
the backends' in-flight load):
- a replica that holds it: the request is routed as any other, among the holders placement
  allows (the policy then picks by its own signals: prefix pins, KV blocks, load, all per
  adapter), with every other candidate excluded, so no fallback is a replica that would
  answer 404 for an adapter it lacks;
- one that must load it: a `Wait`. The load is begun once per (backend, adapter) (single
  flight: a second request finds it in flight and waits for the same one), ordered through
  `start_load` (the plumbing's: control/server/adapter_loader.py), and the request is parked
  until `loaded` says it ended; it is then routed again, and finds the holder;
- nothing can serve it (its base has no adapter engine up, or every one failed to load it
  lately): a refusal saying why.

A failover's resume (`resume`) prefers any surviving holder, so a resumed stream waits for a
load only when no replica holds the adapter. Parked requests that wait past `load_timeout`
are given back by `expired` to be refused."""

# baton: pure

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from baton.model import Adapter, BackendId, Decision, Reason, RouteRequest
from control.fleet.registry import Registry
from control.routing.adapters import Placement, PlaceReason, Tuning, place, place_resume
from control.settings import LoraSettings


@dataclass(frozen=True, slots=True)
class LoadOrder:
    """Load `adapter` on `backend`, unloading `evict` there first (the plumbing's job)."""

    backend: BackendId
    adapter: Adapter
    evict: tuple[str, ...]
    reason: PlaceReason
    request_id: str  # the request whose route began it


@dataclass(frozen=True, slots=True)
class LoadResult:
    """How a load ended: `detail` the engine's answer when it failed; `evicted` what was
    unloaded first."""

    ok: bool
    ms: float
    detail: str = ""
    evicted: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Steered:
    """Route `request` (others excluded) as any request; `placement` says why there."""

    request: RouteRequest
    placement: Placement


@dataclass(frozen=True, slots=True)
class Wait:
    """The request waits for `adapter`'s load on `backend`."""

    backend: BackendId
    adapter: str


@dataclass(slots=True)
class Parked:
    """A request waiting for a load, with what routing it again needs."""

    request: RouteRequest
    reason: Reason | None  # FAILOVER for a resume
    preferred: tuple[str, ...]
    reply: Callable[[Any], None] | None  # the plumbing's way back (admission.Reply)
    since: float


class AdapterFlow:
    def __init__(
        self,
        registry: Registry,
        settings: LoraSettings,
        start_load: Callable[[LoadOrder], None] | None = None,
    ) -> None:
        self._registry = registry
        self.settings = settings
        self._tuning = Tuning(
            per_replica_rate=settings.per_replica_rate,
            saturated_at=settings.saturated_at or math.inf,
            min_idle=settings.min_idle,
        )
        self.start_load = start_load
        self._parked: dict[tuple[str, str], list[Parked]] = {}
        # Each routed adapter request's (backend, adapter) until it ends: what is in use is
        # never unloaded (Residency.begin_use).
        self._uses: dict[str, tuple[str, str]] = {}

    def steer(
        self, request: RouteRequest, now: float, *, resume: bool
    ) -> Steered | Wait | Decision | None:
        """Where the request may go (module docstring); None: it names no adapter."""
        reg = self._registry
        snapshot = reg.snapshot
        adapter = snapshot.adapter(request.shape.model) if snapshot.adapters else None
        if adapter is None:
            return None
        book = reg.adapters
        serving: list[str] = [s.backend.id for s in snapshot.serving(adapter.name)
                              if s.routable and s.backend.id not in request.exclude]  # fmt: skip
        failed = {b: why for b in serving if (why := book.failed_lately(b, adapter.name, now))}
        candidates = [b for b in serving if b not in failed]
        if not resume:
            book.demand.observe(adapter.name, now)
        rate = book.demand.rate(adapter.name, now)
        load: dict[str, float] = {b: float(n) for b, n in reg.in_flight().items()}
        res = book.residency
        if resume:
            placement = place_resume(adapter.name, "", candidates, res, rate, load, self._tuning,
                                     now=now)  # fmt: skip
        else:
            placement = place(adapter.name, candidates, res, rate, load, self._tuning, now=now)
        if placement.backend is None:
            return Decision((), Reason.NO_BACKEND, snapshot.version,
                            _nowhere(adapter, serving, failed))  # fmt: skip
        target = BackendId(placement.backend)
        if placement.needs_load:
            if res.begin_load(target, adapter.name):
                for victim in placement.evict:
                    # Gone for routing now, not once the engine has answered: no request may
                    # be sent to it between this decision and its unload.
                    book.leave(target, victim)
                if self.start_load is not None:
                    self.start_load(LoadOrder(target, adapter, placement.evict,
                                              placement.reason, request.request_id))  # fmt: skip
            return Wait(target, adapter.name)
        allowed = {target} | {b for b in placement.home if res.holds(b, adapter.name)
                              and load.get(b, 0.0) < self._tuning.saturated_at}  # fmt: skip
        others = frozenset(BackendId(b) for b in serving if b not in allowed)
        # A pair's draft runs the base, not the adapter: an adapter's request is served
        # target-only (docs/routing.md#adapter-fleets).
        shape = replace(request.shape, spec_eligible=False)
        return Steered(replace(request, exclude=request.exclude | others, shape=shape), placement)

    def used(self, request: RouteRequest, backend: BackendId, now: float) -> None:
        """The request was routed to `backend`: its adapter is the newest there, and in use
        until the request ends (`done`)."""
        name = request.shape.model
        if self._registry.snapshot.adapter(name) is None:
            return
        res = self._registry.adapters.residency
        res.touch(backend, name, now)
        self.done(request.request_id)  # a failover's resume: it left the failed backend
        self._uses[request.request_id] = (backend, name)
        res.begin_use(backend, name)

    def done(self, request_id: str) -> None:
        """The request ended (or moved): its adapter is no longer in use by it."""
        use = self._uses.pop(request_id, None) if self._uses else None
        if use is not None:
            self._registry.adapters.residency.end_use(*use)

    def forget_stale(self, held: set[str]) -> int:
        """Uses of requests control no longer counts in flight (a shim that died without
        reporting their ends: the registry's load expiry dropped them); how many."""
        stale = [rid for rid in self._uses if rid not in held]
        for rid in stale:
            self.done(rid)
        return len(stale)

    # -- requests waiting for a load ----------------------------------------------------------

    def park(self, wait: Wait, parked: Parked) -> None:
        self._parked.setdefault((wait.backend, wait.adapter), []).append(parked)

    def loaded(
        self, backend: str, adapter: str, ok: bool, now: float, why: str = ""
    ) -> list[Parked]:
        """A load ended: the book learns it; the requests that waited for it, to route again
        (on a failure they go elsewhere: the backend is not tried again for `retry_after`)."""
        self._registry.adapters.loaded(backend, adapter, ok, now, why, self.settings.retry_after)
        return self._parked.pop((backend, adapter), [])

    def expired(self, now: float) -> list[Parked]:
        """Parked requests that waited `load_timeout`: refused by the caller."""
        out: list[Parked] = []
        for key in list(self._parked):
            waiting = self._parked[key]
            late = [p for p in waiting if now - p.since >= self.settings.load_timeout]
            if late:
                out += late
                self._parked[key] = [p for p in waiting if p not in late]
                if not self._parked[key]:
                    del self._parked[key]
        return out

    def left(self, request_id: str) -> bool:
        """The request's client left while it waited: it is dropped (True if it waited)."""
        if not self._parked:
            return False
        for key, waiting in list(self._parked.items()):
            kept = [p for p in waiting if p.request.request_id != request_id]
            if len(kept) != len(waiting):
                if kept:
                    self._parked[key] = kept
                else:
                    del self._parked[key]
                return True
        return False

    @property
    def parked(self) -> int:
        return sum(len(v) for v in self._parked.values())


def _nowhere(adapter: Adapter, serving: Sequence[str], failed: dict[str, str]) -> str:
    if not serving:
        return (f"no routable replica of {adapter.base!r} serves adapters (--enable-lora), "
                f"so none can serve {adapter.name!r}")  # fmt: skip
    first = next(iter(failed.items()))
    return (f"adapter {adapter.name!r} failed to load on every replica of {adapter.base!r} "
            f"lately (on {first[0]}: {first[1]})")  # fmt: skip
