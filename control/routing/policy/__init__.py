"""Routing policies: one small module per policy, chosen by name from this table."""

from __future__ import annotations

from collections.abc import Callable

from control.routing.policy.adaptive import Adaptive, SpillGuard
from control.routing.policy.affinity import Affinity
from control.routing.policy.base import Policy, RoutingView, look_up
from control.routing.policy.roundrobin import RoundRobin
from control.routing.policy.ttft import PredictedTTFT

POLICIES: dict[str, Callable[[SpillGuard], Policy]] = {
    "roundrobin": lambda guard: RoundRobin(),
    "affinity": lambda guard: Affinity(),
    "adaptive": lambda guard: Adaptive(guard),
    "ttft": lambda guard: PredictedTTFT(),
}

DEFAULT_POLICY = "adaptive"
# When the config's backends publish KV events: the engines say what they hold and how busy
# they are, and ttft predicts from it (bench.kv_routing --real; see docs/routing.md).
KV_DEFAULT_POLICY = "ttft"


def make_policy(name: str, guard: SpillGuard | None = None) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown routing policy {name!r} (known: {known})") from None
    return factory(guard or SpillGuard())


__all__ = ["DEFAULT_POLICY", "KV_DEFAULT_POLICY", "POLICIES", "Policy", "RoutingView",
           "SpillGuard", "look_up", "make_policy"]  # fmt: skip
