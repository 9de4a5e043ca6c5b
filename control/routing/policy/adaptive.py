"""Adaptive: continuations stick to their prefix's backend, everything else spreads."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from baton.model import Backend, BackendId, BackendStatus, Decision, Reason, RouteRequest
from baton.spread import first
from control.routing.policy.base import RoutingView


@dataclass(frozen=True, slots=True)
class SpillGuard:
    """A pinned backend is overloaded when its in-flight count exceeds factor x the mean of
    the other routable backends plus slack (slack keeps an idle fleet from spilling warm
    turns over one or two requests; comparing with the others, not a mean that includes
    the pinned one, lets a two-card fleet spill at all)."""

    factor: float = 2.0
    slack: int = 2

    def overloaded(self, pinned: int, others: list[int]) -> bool:
        if not others:
            return False
        return pinned > self.factor * (sum(others) / len(others)) + self.slack


class Adaptive:
    """Reads: the request's longest pinned prefix, which of its messages are assistant
    turns, the routable backends and their in-flight counts.
    Returns: for a continuation (the pinned prefix contains an assistant turn: an agent loop
    coming back), the pinned backend (pin-hit), or the least loaded other backend when the
    pinned one is past the spill guard (spill), or the spread choice when the pinned one is
    gone (repin). Anything else spreads by counter: a fresh prefix is never hashed to pick a
    card, so a burst sharing a system prompt lands on all of them.
    Ties: the spread counter (spill: lowest load, then ring order)."""

    name = "adaptive"
    predicts = False

    def __init__(self, guard: SpillGuard | None = None) -> None:
        self._guard = guard or SpillGuard()

    def decide(self, request: RouteRequest, view: RoutingView) -> Decision:
        routable, ring = view.routable, view.ring
        version = view.snapshot.version
        match = view.pin
        turns = request.shape.assistant_turns
        if match is None or not any(turns[: match.index + 1]):
            return Decision(ring, Reason.SPREAD, version)
        pinned_id = match.pin.backend_id
        pinned = next((b for b in routable if b.backend.id == pinned_id), None)
        if pinned is None:
            return Decision(ring, Reason.REPIN, version, f"pinned {pinned_id} is gone")
        load = view.load
        others = [b for b in routable if b.backend.id != pinned_id]
        in_flight = load.get(pinned_id, 0)
        if self._guard.overloaded(in_flight, [load.get(b.backend.id, 0) for b in others]):
            target = _least_loaded(others, ring, load)
            return Decision(
                first(target.backend, ring),
                Reason.SPILL,
                version,
                f"pinned {pinned_id} has {in_flight} in flight",
            )
        return Decision(first(pinned.backend, ring), Reason.PIN_HIT, version)


def _least_loaded(
    others: list[BackendStatus], ring: tuple[Backend, ...], load: Mapping[BackendId, int]
) -> BackendStatus:
    order = {b.id: i for i, b in enumerate(ring)}
    return min(others, key=lambda b: (load.get(b.backend.id, 0), order[b.backend.id]))
