from __future__ import annotations

import pytest

from baton import wire
from baton.model import BackendId, HealthState, Snapshot
from control.exceptions import BackendExists, BackendNotFound
from control.fleet.registry import Registry
from control.settings import HealthPolicy
from tests.factories import backend


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(*ids: str) -> tuple[Registry, FakeClock]:
    clock = FakeClock()
    return Registry(
        [backend(i) for i in ids],
        clock=clock,
        health_policy=HealthPolicy(readmit_after=2, down_after=3),
    ), clock


def state(reg: Registry, bid: str) -> HealthState:
    s = reg.snapshot.get(bid)
    assert s is not None
    return s.health.state


def test_passive_failure_demotes_at_once_with_reason_and_time() -> None:
    reg, clock = make("a", "b")
    clock.t = 1234.0
    reg.report_failure("a", "connect: refused")
    s = reg.snapshot.get("a")
    assert s is not None and s.health.state is HealthState.DEMOTED
    assert s.health.reason == "connect: refused" and s.health.since == 1234.0
    assert state(reg, "b") is HealthState.HEALTHY


def test_readmission_needs_consecutive_good_probes() -> None:
    reg, _ = make("a")
    reg.report_failure("a", "boom")
    reg.probe_result("a", True)
    assert state(reg, "a") is HealthState.DEMOTED
    reg.probe_result("a", False, "timeout")
    reg.probe_result("a", True)
    assert state(reg, "a") is HealthState.DEMOTED
    reg.probe_result("a", True)
    assert state(reg, "a") is HealthState.HEALTHY


def test_repeated_probe_failures_mark_down() -> None:
    reg, _ = make("a")
    for _ in range(3):
        reg.probe_result("a", False, "refused")
    assert state(reg, "a") is HealthState.DOWN


def test_a_slow_probe_is_not_a_failure_until_slow_after_in_a_row() -> None:
    """A probe that times out finds an engine that is alive and may only be busy: one alone
    demotes nothing; `slow_after` (2) in a row do, and a refused probe still demotes at once."""
    reg, _ = make("a", "b")
    reg.probe_result("a", False, "timeout after 1s", slow=True)
    assert state(reg, "a") is HealthState.HEALTHY
    reg.probe_result("a", True)  # a good probe between two slow ones: the streak starts over
    reg.probe_result("a", False, "timeout after 1s", slow=True)
    assert state(reg, "a") is HealthState.HEALTHY
    reg.probe_result("a", False, "timeout after 1s", slow=True)
    assert state(reg, "a") is HealthState.DEMOTED
    reg.probe_result("b", False, "timeout after 1s", slow=True)
    reg.probe_result("b", False, "connect: refused")
    assert state(reg, "b") is HealthState.DEMOTED


def test_undrain_after_one_slow_probe_is_healthy_and_after_a_refusal_demoted() -> None:
    reg, _ = make("a", "b")
    for bid, slow, why in (("a", True, "timeout after 1s"), ("b", False, "connect: refused")):
        reg.drain(bid)
        reg.probe_result(bid, False, why, slow=slow)
        reg.undrain(bid)
    assert state(reg, "a") is HealthState.HEALTHY
    assert state(reg, "b") is HealthState.DEMOTED


def test_drain_dominates_probes_and_undrain_restores() -> None:
    reg, _ = make("a")
    reg.drain("a")
    reg.probe_result("a", True)
    reg.report_failure("a", "x")
    assert state(reg, "a") is HealthState.DRAINING
    reg.undrain("a")
    assert state(reg, "a") is HealthState.HEALTHY


def test_snapshots_are_versioned_and_published_only_on_visible_change() -> None:
    reg, _ = make("a")
    seen: list[Snapshot] = []
    reg.subscribe(seen.append)
    v0 = reg.snapshot.version
    reg.probe_result("a", True)  # healthy stays healthy: no new snapshot
    assert seen == []
    reg.add(backend("b"))
    reg.drain("b")
    reg.remove("a")
    assert [s.version for s in seen] == [v0 + 1, v0 + 2, v0 + 3]
    assert [b.backend.id for b in seen[-1].backends] == ["b"]
    # Old snapshots are untouched by later changes.
    assert [b.backend.id for b in seen[0].backends] == ["a", "b"]


def test_refusals() -> None:
    reg, _ = make("a")
    with pytest.raises(BackendExists):
        reg.add(backend("a"))
    with pytest.raises(BackendNotFound):
        reg.drain("zz")
    assert reg.report_failure("zz", "gone") is None  # removed mid-request: ignored


def test_load_is_released_and_expires() -> None:
    reg, _ = make("a")
    reg.acquire("r1", BackendId("a"), now=0.0)
    reg.acquire("r2", BackendId("a"), now=0.0)
    assert reg.in_flight()["a"] == 2
    reg.release("r1")
    assert reg.in_flight()["a"] == 1
    assert reg.expire_load(now=10_000.0) == 1
    assert dict(reg.in_flight()) == {}


def test_route_events_off_keeps_the_other_events() -> None:

    from baton.model import Failure, RequestShape, RouteRequest
    from control.routing.policy import make_policy
    from control.routing.router import Router

    reg, clock = make("a")
    router = Router(
        reg, make_policy("adaptive"), clock=clock, route_events=False
    )
    assert router.route(RouteRequest("r1", RequestShape(model="m"))).backends
    router.attempt_failed("r1", "a", Failure.CONNECT, "refused")
    assert [e.kind.value for e in reg.events] == ["health", "retry"]


def test_drain_with_migrate_stays_draining_and_reaches_the_snapshot() -> None:
    reg, _ = make("a", "b")
    seen: list[Snapshot] = []
    reg.subscribe(seen.append)
    status = reg.drain("a", migrate=True)
    assert status.health.state is HealthState.DRAINING and status.migrating
    assert seen[-1].get("a").migrating  # type: ignore[union-attr]
    pb = wire.snapshot_to_pb(seen[-1], {})
    assert [(s.backend.id, s.migrating) for s in pb.backends] == [("a", True), ("b", False)]
    assert reg.drained() == {"a": True}
    drains = [e for e in reg.events if e.data.get("action") == "drain"]
    assert drains[-1].data["migrate"] is True


def test_migrate_alone_is_a_new_snapshot_and_undrain_clears_it() -> None:
    reg, _ = make("a")
    reg.drain("a")
    assert not reg.snapshot.get("a").migrating  # type: ignore[union-attr]
    v = reg.snapshot.version
    reg.drain("a", migrate=True)  # already draining: only the migrate flag changes
    assert reg.snapshot.version == v + 1 and reg.snapshot.get("a").migrating  # type: ignore[union-attr]
    reg.undrain("a")
    after = reg.snapshot.get("a")
    assert after is not None and not after.migrating and after.health.state is HealthState.HEALTHY
    assert reg.drained() == {}


def test_restored_drains_come_back_without_an_audit_event() -> None:
    drained = {"a": True, "gone": False}  # "gone" was removed from the config since
    reg = Registry([backend("a"), backend("b")], clock=FakeClock(), drained=drained)
    assert state(reg, "a") is HealthState.DRAINING and state(reg, "b") is HealthState.HEALTHY
    assert reg.snapshot.get("a").migrating  # type: ignore[union-attr]
    assert list(reg.events) == []
