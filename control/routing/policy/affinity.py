"""Affinity: always follow the longest pinned prefix; spread what has none."""

# baton: pure

from __future__ import annotations

from baton.model import Decision, Reason, RouteRequest
from baton.spread import first
from control.routing.policy.base import RoutingView


class Affinity:
    """Reads: the request's longest pinned prefix and the routable backends.
    Returns: the pinned backend first when it is routable (pin-hit); when it is gone
    (dead, drained, removed) the spread choice (repin); with no pin, the spread choice.
    Ties: the spread counter. Known cost: a burst sharing a system prompt all follows the
    first member's pin to one card (what `adaptive` avoids)."""

    name = "affinity"
    predicts = False

    def decide(self, request: RouteRequest, view: RoutingView) -> Decision:
        ring, version = view.ring, view.snapshot.version
        if view.pin is None:
            return Decision(ring, Reason.SPREAD, version)
        pinned = next(
            (b.backend for b in view.routable if b.backend.id == view.pin.pin.backend_id), None
        )
        if pinned is None:
            return Decision(
                ring, Reason.REPIN, version, f"pinned {view.pin.pin.backend_id} is gone"
            )
        return Decision(first(pinned, ring), Reason.PIN_HIT, version)
