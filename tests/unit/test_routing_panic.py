"""Panic routing: with no healthy backend, control tries demoted and down ones, never drained."""

from __future__ import annotations

from baton.model import BackendId, Reason, RequestShape, RouteRequest
from dataplane.link.degraded import DegradedRouter
from tests.factories import router


def test_no_healthy_backend_tries_the_demoted_then_the_down_never_the_drained() -> None:
    r, reg = router("abcd")
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
    r, reg = router("abcd")
    for b in "abc":
        reg.report_failure(b, "connect")
    assert [b.id for b in r.route(RouteRequest("r1", RequestShape("m"))).backends][0] == "d"
    reg.drain("d")
    everything = frozenset(BackendId(b) for b in "abc")
    d = r.route(RouteRequest("r2", RequestShape("m"), exclude=everything))
    assert d.backends == () and d.reason is Reason.NO_BACKEND


def test_control_in_panic_and_a_shim_without_control_try_the_same_backends_in_one_order() -> None:
    """One panic order (baton/spread.py): a shim routing alone from control's last snapshot
    tries the backends health took out in the order control itself would."""
    r, reg = router("abcde")
    for _ in range(5):
        reg.probe_result("b", False, "refused")  # down
    reg.report_failure("a", "connect")
    reg.report_failure("c", "connect")
    reg.report_failure("d", "connect")
    reg.drain("e")
    control = r.route(RouteRequest("r1", RequestShape("m"))).backends
    alone = DegradedRouter().route(reg.snapshot, "m").backends
    assert [b.id for b in control] == [b.id for b in alone]
    assert [b.id for b in control][-1] == "b" and "e" not in [b.id for b in control]
