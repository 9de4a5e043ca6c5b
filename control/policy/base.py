"""The whole policy contract. Policies are pure and synchronous: no I/O, no clock or global
randomness (both come in as arguments), and they never raise for "no capacity"."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from random import Random
from typing import Protocol

from baton.model import BackendId, Decision, RouteRequest, Snapshot
from control.affinity import PinMatch


@dataclass(frozen=True, slots=True)
class RoutingView:
    """What a policy may read: the fleet, its load, and the request's longest pinned prefix
    (looked up by the router, which owns the pin table)."""

    snapshot: Snapshot
    load: Mapping[BackendId, int]
    pin: PinMatch | None = None


class Policy(Protocol):
    name: str

    def decide(
        self, request: RouteRequest, view: RoutingView, *, rng: Random, now: float
    ) -> Decision: ...
