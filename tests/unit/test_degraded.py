"""Degraded routing: what a shim decides alone from the last snapshot while control is away."""

from __future__ import annotations

import pytest

from baton.model import (
    BackendStatus,
    HealthState,
    Reason,
    Role,
    Snapshot,
)
from dataplane.link.degraded import DegradedRouter
from tests.factories import status

H, DEM, DRN, DOWN = (
    HealthState.HEALTHY,
    HealthState.DEMOTED,
    HealthState.DRAINING,
    HealthState.DOWN,
)


def ids(router: DegradedRouter, snap: Snapshot, n: int, **kw: object) -> list[tuple[str, ...]]:
    return [tuple(b.id for b in router.route(snap, "m", **kw).backends) for _ in range(n)]  # type: ignore[arg-type]


def test_round_robin_over_healthy_backends_marked_degraded() -> None:
    snap = Snapshot(7, (status("a"), status("b"), status("c")))
    router = DegradedRouter()
    decisions = [router.route(snap, "m") for _ in range(6)]
    assert [d.backends[0].id for d in decisions] == ["a", "b", "c", "a", "b", "c"]
    assert all(d.reason is Reason.DEGRADED and d.snapshot_version == 7 for d in decisions)
    # every decision lists every healthy backend once: the fallbacks for a retry
    assert all(sorted(b.id for b in d.backends) == ["a", "b", "c"] for d in decisions)
    assert "control plane unreachable" in decisions[0].detail


@pytest.mark.parametrize(
    ("backends", "want"),
    [
        # only healthy backends serve: demoted, draining, down are skipped
        ((status("a"), status("b", DEM), status("c", DRN), status("d", DOWN)), {"a"}),
        # drafts serve only through a pair, never a client
        ((status("a"), status("d", role=Role.DRAFT)), {"a"}),
        # targets serve clients like any backend
        ((status("a"), status("t", role=Role.TARGET)), {"a", "t"}),
        # other models' backends are not candidates
        ((status("a"), status("x", model="other")), {"a"}),
    ],
)
def test_candidates(backends: tuple[BackendStatus, ...], want: set[str]) -> None:
    primaries = {row[0] for row in ids(DegradedRouter(), Snapshot(1, backends), 8)}
    assert primaries == want


@pytest.mark.parametrize(
    ("backends", "model", "reason"),
    [
        ((status("a"),), "nope", Reason.UNKNOWN_MODEL),
        ((status("a", DRN),), "m", Reason.NO_BACKEND),  # drained: the operator's word
        ((status("d", role=Role.DRAFT),), "m", Reason.UNKNOWN_MODEL),
        ((), "m", Reason.UNKNOWN_MODEL),
    ],
)
def test_no_backend_is_a_decision_not_an_error(
    backends: tuple[BackendStatus, ...], model: str, reason: Reason
) -> None:
    d = DegradedRouter().route(Snapshot(3, backends), model)
    assert d.backends == () and d.reason is reason and d.snapshot_version == 3
    assert "control plane unreachable" in d.detail


def test_failover_excludes_the_failed_and_tried_backends() -> None:
    snap = Snapshot(1, (status("a"), status("b"), status("c")))
    rows = ids(DegradedRouter(), snap, 4, exclude=("a", "b"))
    assert rows == [("c",)] * 4
    d = DegradedRouter().route(snap, "m", exclude=("a", "b", "c"))
    assert d.backends == () and d.reason is Reason.NO_BACKEND


@pytest.mark.parametrize(
    ("preferred", "exclude", "first"),
    [
        (("c",), ("a",), "c"),  # the route's own next fallback, still fit: taken
        (("a", "c"), ("a",), "c"),  # the failed one is skipped even when preferred
        (("d", "b"), (), "b"),  # d is demoted in the snapshot
        (("zz",), (), "a"),  # unknown: plain round robin
    ],
)
def test_failover_honours_preferred_when_fit(
    preferred: tuple[str, ...], exclude: tuple[str, ...], first: str
) -> None:
    snap = Snapshot(1, (status("a"), status("b"), status("c"), status("d", DEM)))
    d = DegradedRouter().route(snap, "m", exclude=exclude, preferred=preferred)
    assert d.backends[0].id == first and d.reason is Reason.DEGRADED
    assert not set(exclude) & {b.id for b in d.backends}


def test_models_rotate_independently() -> None:
    snap = Snapshot(1, (status("a"), status("b"), status("x", model="n"), status("y", model="n")))
    router = DegradedRouter()
    got = [router.route(snap, m).backends[0].id for m in ("m", "n", "m", "n")]
    assert got == ["a", "x", "b", "y"]


def test_backends_the_snapshot_calls_down_are_tried_last_never_drained_ones() -> None:
    """The snapshot ages during an outage: the healthy may have died and the down come back.
    They go in control's panic order (baton/spread.py: last_resort): demoted before down."""
    snap = Snapshot(1, (status("a"), status("b", DOWN), status("c", DEM), status("d", DRN)))
    d = DegradedRouter().route(snap, "m")
    assert [b.id for b in d.backends] == ["a", "c", "b"] and d.reason is Reason.DEGRADED
    none_healthy = Snapshot(1, (status("b", DOWN), status("d", DRN)))
    d = DegradedRouter().route(none_healthy, "m", exclude=())
    assert [b.id for b in d.backends] == ["b"] and d.reason is Reason.DEGRADED
    assert DegradedRouter().route(none_healthy, "m", exclude=("b",)).backends == ()
