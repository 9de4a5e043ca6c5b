"""Routing policies: one small module per policy, chosen by name from this table."""

from __future__ import annotations

from collections.abc import Callable

from control.policy.base import Policy
from control.policy.roundrobin import RoundRobin

POLICIES: dict[str, Callable[[], Policy]] = {
    "roundrobin": RoundRobin,
}

DEFAULT_POLICY = "roundrobin"


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown routing policy {name!r} (known: {known})") from None


__all__ = ["DEFAULT_POLICY", "POLICIES", "Policy", "make_policy"]
