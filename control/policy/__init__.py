"""Routing policies: one small module per policy, chosen by name from this table."""

from __future__ import annotations

from collections.abc import Callable

from control.policy.adaptive import Adaptive, SpillGuard
from control.policy.affinity import Affinity
from control.policy.base import Policy, RoutingView
from control.policy.roundrobin import RoundRobin
from control.policy.ttft import PredictedTTFT

POLICIES: dict[str, Callable[[SpillGuard], Policy]] = {
    "roundrobin": lambda guard: RoundRobin(),
    "affinity": lambda guard: Affinity(),
    "adaptive": lambda guard: Adaptive(guard),
    # Selectable, not a default yet: on bench.kv_routing it is behind adaptive (see README).
    "ttft": lambda guard: PredictedTTFT(),
}

DEFAULT_POLICY = "adaptive"


def make_policy(name: str, guard: SpillGuard | None = None) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown routing policy {name!r} (known: {known})") from None
    return factory(guard or SpillGuard())


__all__ = ["DEFAULT_POLICY", "POLICIES", "Policy", "RoutingView",
           "SpillGuard", "make_policy"]  # fmt: skip
