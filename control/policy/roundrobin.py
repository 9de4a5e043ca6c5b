"""Round robin: a per-model counter over the routable backends."""

from __future__ import annotations

from collections.abc import Mapping
from random import Random

from control.model import BackendId, Decision, Reason, RouteRequest, Snapshot
from control.policy.base import candidates


class RoundRobin:
    """Reads: the snapshot's routable backends for the model (sorted by id).
    Returns: all of them, rotated so the primary advances by one per decision; the rest
    are the fallbacks in ring order. Ties: none — the counter alone decides."""

    name = "roundrobin"

    def __init__(self) -> None:
        # The counter is the policy's own bookkeeping, not fleet state: losing it on
        # restart only shifts where the ring starts.
        self._next: dict[str, int] = {}

    def decide(
        self,
        request: RouteRequest,
        snapshot: Snapshot,
        load: Mapping[BackendId, int],
        *,
        rng: Random,
        now: float,
    ) -> Decision:
        routable, refusal = candidates(request, snapshot)
        if refusal is not None:
            return refusal
        model = request.shape.model
        start = self._next.get(model, 0) % len(routable)
        self._next[model] = start + 1
        ring = routable[start:] + routable[:start]
        return Decision(tuple(b.backend for b in ring), Reason.SPREAD, snapshot.version)
