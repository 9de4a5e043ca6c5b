"""The whole policy contract. Policies are pure and synchronous: no I/O, no clock, no
randomness. The router's lookup does the work every policy shares (`look_up`): the
candidates (the model's routable backends, minus the request's exclusions), the refusal when
there are none (the policy is not asked then), and the spread ring over the candidates; a
policy only orders them."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from baton.model import Backend, BackendId, BackendStatus, Decision, RouteRequest, Snapshot
from baton.spread import Spreader, candidates
from control.fleet.pins import PinMatch
from control.routing.prefill import Rates


@dataclass(frozen=True, slots=True)
class Prediction:
    """Per backend, what a TTFT estimate is made of (control/routing/policy/ttft.py): the prefill
    work Baton sent it that is still ahead (ms), the requests on it Baton did not send, the prompt
    tokens it has cached (backends with a live KV index only), its learned rates; and the
    prompt's size in tokens when a shim reported it for this prefix."""

    backlog_ms: Mapping[BackendId, float] = field(default_factory=dict)
    outside: Mapping[BackendId, float] = field(default_factory=dict)
    cached_tokens: Mapping[BackendId, int] = field(default_factory=dict)
    rates: Mapping[BackendId, Rates] = field(default_factory=dict)
    prompt_tokens: int | None = None
    # learned (control/routing/prefill.py): a prompt's size from its characters
    chars_per_token: float = 4.0


@dataclass(frozen=True, slots=True)
class RoutingView:
    """What a policy may read: the fleet, its load, the candidates (never empty) and their
    spread ring (the counter's primary first, then the fallbacks in rotating order), the
    request's longest pinned prefix (or its session's pin), all looked up by the router,
    which owns the tables; and, for policies that predict, the per-backend terms of the
    prediction."""

    snapshot: Snapshot
    load: Mapping[BackendId, int]
    routable: tuple[BackendStatus, ...]
    ring: tuple[Backend, ...]
    pin: PinMatch | None = None
    predict: Prediction | None = None


def look_up(
    request: RouteRequest,
    snapshot: Snapshot,
    load: Mapping[BackendId, int],
    spread: Spreader,
    pin: PinMatch | None = None,
    predict: Prediction | None = None,
) -> RoutingView | Decision:
    """The view a policy decides over, its ring from `spread` (the router's counters); or,
    with no candidate, the refusal (unknown-model, no-backend) that is the decision."""
    routable, refusal = candidates(request, snapshot)
    if refusal is not None:
        return refusal
    ring = spread.ring(request.shape.model, routable)
    return RoutingView(snapshot, load, routable, ring, pin, predict)


class Policy(Protocol):
    name: str
    predicts: bool  # reads RoutingView.predict (the router builds it only then: it costs)

    def decide(self, request: RouteRequest, view: RoutingView) -> Decision:
        """Order `view.ring` (every candidate, each once), with the reason; never empty."""
        ...
