"""Round robin: spread every request by counter; pins are ignored."""

# baton: pure

from __future__ import annotations

from baton.model import Decision, Reason, RouteRequest
from control.routing.policy.base import RoutingView


class RoundRobin:
    """Reads: the spread ring over the routable backends for the model.
    Returns: the ring as it is (its primary advances by one per decision; the rest are
    fallbacks in ring order). Ties: none, the counter alone decides."""

    name = "roundrobin"
    predicts = False

    def decide(self, request: RouteRequest, view: RoutingView) -> Decision:
        return Decision(view.ring, Reason.SPREAD, view.snapshot.version)
