"""Ownership pins (control/fleet/owners.py) and the router's owner routes: a stored response's
follow-up goes to the backend that holds it, or is refused saying where it was."""

from __future__ import annotations

import pytest

from baton.model import Reason, RequestShape, RouteRequest
from control.fleet.owners import OwnerTable
from tests.factories import router


def test_lookups_keep_a_pin_warm_and_the_least_recently_used_goes_first() -> None:
    t = OwnerTable(capacity=2, ttl=10.0)
    t.record("r1", "a", "m", 0.0)
    t.record("r2", "b", "m", 1.0)
    assert t.owner("r1", 2.0) is not None  # r1 is now the most recently used
    t.record("r3", "c", "m", 3.0)
    assert t.owner("r2", 3.0) is None and len(t) == 2
    assert [o.key for o in t] == ["r1", "r3"]
    owned = t.owner("r1", 4.0)
    assert owned is not None and owned.backend_id == "a" and owned.hits == 2


def test_a_pin_ages_out_after_its_ttl_without_use_and_a_release_forgets_it() -> None:
    t = OwnerTable(ttl=10.0)
    t.record("r1", "a", "m", 0.0)
    assert t.owner("r1", 9.0) is not None
    assert t.owner("r1", 18.0) is not None  # used at 9: 9 s since
    assert t.owner("r1", 28.5) is None and len(t) == 0
    t.record("r2", "a", "m", 0.0)
    assert t.release("r2") and not t.release("r2") and t.owner("r2", 0.0) is None


def test_a_follow_up_goes_to_its_owner_however_the_policy_would_spread_it() -> None:
    r, reg = router("abc")
    r.record_owner("resp_1", "b", "m")
    for i in range(4):
        d = r.route(RouteRequest(f"r{i}", RequestShape("m", owner_key="resp_1")))
        assert [x.id for x in d.backends] == ["b"] and d.reason is Reason.OWNER
    assert reg.in_flight()["b"] == 4  # counted like any request, released by its outcome


@pytest.mark.parametrize(
    ("change", "state"),
    [
        (lambda reg: [reg.probe_result("b", False, "refused") for _ in range(6)], "down"),
        (lambda reg: reg.drain("b"), "draining"),
        (lambda reg: reg.remove("b"), "removed"),
    ],
)
def test_a_follow_up_whose_owner_is_gone_is_refused_naming_it(change: object, state: str) -> None:
    r, reg = router("abc")
    r.record_owner("resp_1", "b", "m")
    change(reg)  # type: ignore[operator]
    d = r.route(RouteRequest("r1", RequestShape("m", owner_key="resp_1")))
    assert d.backends == () and d.reason is Reason.OWNER_GONE
    assert d.detail == f"resp_1 is stored on backend b, which is {state}"


def test_an_unknown_or_released_key_is_refused_not_spread() -> None:
    r, _ = router("abc")
    d = r.route(RouteRequest("r1", RequestShape("m", owner_key="resp_x")))
    assert d.backends == () and d.reason is Reason.OWNER_UNKNOWN and "resp_x" in d.detail
    r.record_owner("resp_2", "a", "m")
    r.release_owner("resp_2")
    d = r.route(RouteRequest("r2", RequestShape("m", owner_key="resp_2")))
    assert d.reason is Reason.OWNER_UNKNOWN
