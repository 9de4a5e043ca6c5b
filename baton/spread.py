"""Spreading requests over a model's routable backends: the candidates (or the refusal when
there are none), the rotating ring of primary and fallbacks, and a failover's preferred
fallback. Shared by control's policies and the shim's degraded mode (routing from the last
snapshot while control is away), so both spread the same way. Pure."""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from baton.model import (
    Backend,
    BackendStatus,
    Decision,
    HealthState,
    Reason,
    RouteRequest,
    Snapshot,
)


def candidates(
    request: RouteRequest, snapshot: Snapshot
) -> tuple[tuple[BackendStatus, ...], Decision | None]:
    """Routable backends for the request's model, minus its exclusions; or the refusal
    every policy gives when there are none."""
    serving = snapshot.serving(request.shape.model)
    if not serving:
        return (), Decision(
            (),
            Reason.UNKNOWN_MODEL,
            snapshot.version,
            f"no backend serves model {request.shape.model!r}",
        )
    routable = tuple(b for b in serving if b.routable and b.backend.id not in request.exclude)
    if not routable:
        states = ", ".join(f"{b.backend.id}={b.health.state}" for b in serving)
        return (), Decision(
            (),
            Reason.NO_BACKEND,
            snapshot.version,
            f"no routable backend for {request.shape.model!r} ({states})",
        )
    return routable, None


class Spreader:
    """Per-model counters over the routable backends: the primary advances by one per call,
    and so does where the fallbacks start, so requests that share a primary do not share
    their first fallback (when a card dies, its streams resume across the survivors instead
    of all landing on its neighbour). The counters are the policy's own bookkeeping, not
    fleet state: losing them on restart only shifts where the rings start."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._fallback: dict[str, int] = {}

    def ring(self, model: str, routable: tuple[BackendStatus, ...]) -> tuple[Backend, ...]:
        start = self._next.get(model, 0) % len(routable)
        self._next[model] = start + 1
        others = routable[start + 1 :] + routable[:start]
        if len(others) > 1:
            k = self._fallback.get(model, 0) % len(others)
            self._fallback[model] = k + 1
            others = others[k:] + others[:k]
        return (routable[start].backend, *(b.backend for b in others))


def first(primary: Backend, ring: tuple[Backend, ...]) -> tuple[Backend, ...]:
    """`primary`, then the ring's other backends as fallbacks."""
    return (primary, *(b for b in ring if b.id != primary.id))


def prefer(decision: Decision, preferred: Sequence[str]) -> Decision:
    """The decision with the first of `preferred` that it contains moved to the front: a
    failover goes where the route's own fallback order said, when that one is still fit."""
    ids = {b.id for b in decision.backends}
    chosen = next((p for p in preferred if p in ids), None)
    if chosen is None or decision.backends[0].id == chosen:
        return decision
    primary = next(b for b in decision.backends if b.id == chosen)
    return replace(decision, backends=first(primary, decision.backends))


# Panic routing's order: demoted backends before down ones (a demotion is one bad report; down
# is several failed probes), each most recently changed first.
_PANIC_ORDER = {HealthState.DEMOTED: 0, HealthState.DOWN: 1}


def last_resort(request: RouteRequest, snapshot: Snapshot) -> tuple[Backend, ...]:
    """The backends serving the request's model that health has taken out (demoted or down),
    minus its exclusions, in panic order (Envoy's panic routing). Tried when no healthy one
    is left rather than refusing: health lags the fleet, so a replica restarted a moment ago
    serves before probes re-admit it, and one really gone fails fast (connect refused) so the
    shim moves on. Never a drained one: draining is the operator's word."""
    out = [
        s
        for s in snapshot.serving(request.shape.model)
        if s.health.state in _PANIC_ORDER and s.backend.id not in request.exclude
    ]
    out.sort(key=lambda s: (_PANIC_ORDER[s.health.state], -s.health.since))
    return tuple(s.backend for s in out)
