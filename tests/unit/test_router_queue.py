"""control/routing/router.py with [admission]: who waits, who is shed, who goes next."""

from __future__ import annotations

from baton.model import (
    Backend,
    BackendId,
    BackendKind,
    Reason,
    RequestOutcome,
    RequestShape,
    Role,
    RouteRequest,
)
from baton.tenancy import Priority, Tenant, digest
from control.fleet.registry import Registry
from control.routing.policy import make_policy
from control.routing.router import Router
from control.settings import AdmissionSettings


def router(max_queued: int = 10) -> Router:
    now = [0.0]
    backend = Backend(BackendId("b0"), "http://127.0.0.1:9", "m", BackendKind.VLLM, Role.SERVE)
    registry = Registry([backend], clock=lambda: now[0])
    for tid, priority in (("jobs", Priority.BATCH), ("app", Priority.INTERACTIVE)):
        registry.tenants.add(Tenant(tid, priority), digest(tid), now=0.0)
    admission = AdmissionSettings(backend_capacity=1, headroom=0.0, max_wait=5.0,
                                  max_queued=max_queued)  # fmt: skip
    return Router(registry, make_policy("roundrobin"), clock=lambda: now[0],
                  admission=admission)  # fmt: skip


def route(r: Router, rid: str, tenant: str) -> Reason:
    return r.route(RouteRequest(rid, RequestShape("m", tenant=tenant, max_tokens=8))).reason


def end(r: Router, rid: str) -> None:
    r.finished([RequestOutcome(request_id=rid, backend_id="b0", model="m", ok=True,
                               http_status=200, completion_tokens=8)])  # fmt: skip


def test_a_full_fleet_holds_requests_and_a_higher_band_goes_first() -> None:
    r = router()
    assert route(r, "r1", "jobs") is Reason.SPREAD  # the one slot
    assert route(r, "r2", "jobs") is Reason.QUEUED
    assert route(r, "r3", "app") is Reason.QUEUED
    assert r.dequeue() == []  # no room yet
    end(r, "r1")
    (first,) = r.dequeue()  # one slot: one goes, the interactive one
    assert first.request_id == "r3" and first.decision.backends[0].id == "b0"
    end(r, "r3")
    assert [a.request_id for a in r.dequeue()] == ["r2"]


def test_a_full_queue_sheds_the_lowest_band_first() -> None:
    r = router(max_queued=1)
    route(r, "r1", "jobs")
    assert route(r, "r2", "jobs") is Reason.QUEUED
    assert route(r, "r3", "app") is Reason.QUEUED  # takes batch's place...
    assert [(a.request_id, a.decision.reason) for a in r.dequeue()] == [("r2", Reason.SHED)]
    assert route(r, "r4", "jobs") is Reason.SHED  # lower than what waits: shed at once
    usage = {u.tenant_id: u for u in r.registry.tenants.usage()}
    assert usage["jobs"].refused == {"saturated": 2} and usage["jobs"].in_flight == 1


def test_a_request_whose_client_left_is_not_routed() -> None:
    r = router()
    route(r, "r1", "jobs")
    assert route(r, "r2", "app") is Reason.QUEUED
    r.finished([RequestOutcome(request_id="r2", backend_id="", model="m", ok=False,
                               http_status=499)])  # fmt: skip
    end(r, "r1")
    assert r.dequeue() == [] and sum(r.queued_by_band().values()) == 0
