"""Round robin: spread every request by counter; pins are ignored."""

# baton: pure

from __future__ import annotations

from random import Random

from baton.model import Decision, Reason, RouteRequest
from baton.spread import Spreader, candidates
from control.routing.policy.base import RoutingView


class RoundRobin:
    """Reads: the routable backends for the model (sorted by id).
    Returns: all of them, rotated so the primary advances by one per decision; the rest are
    fallbacks in ring order. Ties: none, the counter alone decides."""

    name = "roundrobin"
    predicts = False

    def __init__(self) -> None:
        self._spread = Spreader()

    def decide(
        self, request: RouteRequest, view: RoutingView, *, rng: Random, now: float
    ) -> Decision:
        routable, refusal = candidates(request, view.snapshot)
        if refusal is not None:
            return refusal
        ring = self._spread.ring(request.shape.model, routable)
        return Decision(ring, Reason.SPREAD, view.snapshot.version)
