"""Panic routing: with no healthy backend, control tries demoted and down ones, never drained."""

from __future__ import annotations

import random

from baton.model import BackendId, Reason, RequestShape, RouteRequest
from control.backend_spec import make_backend
from control.fleet.registry import Registry
from control.routing.policy import make_policy
from control.routing.router import Router


def router() -> tuple[Router, Registry]:
    reg = Registry(
        [make_backend(b, f"http://127.0.0.1:{i + 1}", "m") for i, b in enumerate("abcd")],
        clock=lambda: 1.0,
    )
    return Router(reg, make_policy("adaptive"), rng=random.Random(0), clock=lambda: 1.0), reg


def test_no_healthy_backend_tries_the_demoted_then_the_down_never_the_drained() -> None:
    r, reg = router()
    reg.report_failure("a", "connect")  # demoted
    for _ in range(5):
        reg.probe_result("b", False, "refused")  # demoted, then down
    reg.report_failure("c", "connect")
    reg.drain("d")
    assert reg.snapshot.get("b").health.state.value == "down"  # type: ignore[union-attr]
    d = r.route(RouteRequest("r1", RequestShape("m")))
    assert d.reason is Reason.DEGRADED and "panic" in d.detail
    assert [b.id for b in d.backends][-1] == "b" and "d" not in [b.id for b in d.backends]
    assert {b.id for b in d.backends} == {"a", "b", "c"}


def test_a_healthy_backend_means_no_panic_and_exclusions_still_hold() -> None:
    r, reg = router()
    for b in "abc":
        reg.report_failure(b, "connect")
    assert [b.id for b in r.route(RouteRequest("r1", RequestShape("m"))).backends][0] == "d"
    reg.drain("d")
    everything = frozenset(BackendId(b) for b in "abc")
    d = r.route(RouteRequest("r2", RequestShape("m"), exclude=everything))
    assert d.backends == () and d.reason is Reason.NO_BACKEND
