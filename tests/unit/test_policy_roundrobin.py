from __future__ import annotations

from baton.model import (
    BackendId,
    Decision,
    HealthState,
    Reason,
    RequestShape,
    Role,
    RouteRequest,
    Snapshot,
)
from baton.spread import Spreader
from control.routing.policy import look_up, make_policy
from control.routing.policy.roundrobin import RoundRobin
from tests.factories import status


def req(model: str = "m", exclude: tuple[str, ...] = ()) -> RouteRequest:
    return RouteRequest("r", RequestShape(model=model), frozenset(BackendId(e) for e in exclude))


def decide(spread: Spreader, snap: Snapshot, request: RouteRequest) -> Decision:
    """As the router asks: the lookup, its ring from `spread` (the router's counters), then
    round robin."""
    found = look_up(request, snap, {}, spread)
    return found if isinstance(found, Decision) else RoundRobin().decide(request, found)


def test_primary_rotates_and_fallbacks_spread() -> None:
    snap = Snapshot(1, (status("a"), status("b"), status("c")))
    rr = Spreader()
    orders = [[b.id for b in decide(rr, snap, req()).backends] for _ in range(6)]
    assert [o[0] for o in orders] == ["a", "b", "c", "a", "b", "c"]
    assert all(sorted(o) == ["a", "b", "c"] for o in orders)
    # Requests that share a primary get different first fallbacks: when that card dies
    # their streams resume on different survivors.
    assert orders[0][1] != orders[3][1] and orders[1][1] != orders[4][1]


def test_unhealthy_excluded_and_other_models_ignored() -> None:
    snap = Snapshot(
        3,
        (
            status("a", HealthState.DEMOTED),
            status("b"),
            status("c", HealthState.DRAINING),
            status("d", HealthState.DOWN),
            status("x", model="other"),
        ),
    )
    d = decide(Spreader(), snap, req())
    assert [b.id for b in d.backends] == ["b"]
    assert d.reason is Reason.SPREAD and d.snapshot_version == 3


def test_exclusions_are_respected() -> None:
    snap = Snapshot(1, (status("a"), status("b")))
    d = decide(Spreader(), snap, req(exclude=("a",)))
    assert [b.id for b in d.backends] == ["b"]


def test_unknown_model_and_no_backend_are_decisions_not_errors() -> None:
    snap = Snapshot(7, (status("a", HealthState.DEMOTED),))
    unknown = decide(Spreader(), snap, req(model="nope"))
    assert unknown.backends == () and unknown.reason is Reason.UNKNOWN_MODEL
    none = decide(Spreader(), snap, req())
    assert none.backends == () and none.reason is Reason.NO_BACKEND
    assert "a=demoted" in none.detail


def test_drafts_do_not_serve_clients() -> None:
    snap = Snapshot(1, (status("d", role=Role.DRAFT), status("t", role=Role.TARGET)))
    assert [b.id for b in decide(Spreader(), snap, req()).backends] == ["t"]


def test_counters_are_per_model() -> None:
    snap = Snapshot(1, (status("a"), status("b"), status("x", model="o"), status("y", model="o")))
    rr = Spreader()
    assert decide(rr, snap, req("m")).backends[0].id == "a"
    assert decide(rr, snap, req("o")).backends[0].id == "x"
    assert decide(rr, snap, req("m")).backends[0].id == "b"


def test_policy_table() -> None:
    assert make_policy("roundrobin").name == "roundrobin"
    try:
        make_policy("nope")
    except ValueError as exc:
        assert "roundrobin" in str(exc)
    else:
        raise AssertionError("unknown policy accepted")
