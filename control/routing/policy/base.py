"""The whole policy contract. Policies are pure and synchronous: no I/O, no clock or global
randomness (both come in as arguments), and they never raise for "no capacity"."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from random import Random
from typing import Protocol

from baton.model import BackendId, Decision, RouteRequest, Snapshot
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
    """What a policy may read: the fleet, its load, the request's longest pinned prefix (or
    its session's pin), all looked up by the router, which owns the tables; and, for policies
    that predict, the per-backend terms of the prediction."""

    snapshot: Snapshot
    load: Mapping[BackendId, int]
    pin: PinMatch | None = None
    predict: Prediction | None = None


class Policy(Protocol):
    name: str
    predicts: bool  # reads RoutingView.predict (the router builds it only then: it costs)

    def decide(
        self, request: RouteRequest, view: RoutingView, *, rng: Random, now: float
    ) -> Decision: ...
