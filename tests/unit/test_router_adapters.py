"""control/routing/router.py with LoRA adapters (issue 42): a request for an adapter no replica
holds waits for one load, however many ask; it is answered once the load ends, where it is
held; a failed load sends the waiting requests elsewhere; a wait past load_timeout is refused;
and the holders' fallbacks never include a replica without the adapter."""

from __future__ import annotations

from typing import Any

from baton.model import (
    Adapter,
    Backend,
    BackendId,
    Reason,
    RequestOutcome,
    RequestShape,
    RouteRequest,
)
from control.fleet.registry import Registry
from control.routing.adapter_flow import LoadOrder
from control.routing.adapters import rank
from control.routing.policy import make_policy
from control.routing.router import Router
from control.settings import AdmissionSettings, LoraSettings

BASE = "m"
IDS = ("b0", "b1", "b2")


class Fleet:
    def __init__(self, *, load_timeout: float = 60.0) -> None:
        self.now = 0.0
        backends = [Backend(BackendId(b), f"http://127.0.0.1:9/{b}", BASE) for b in IDS]
        self.registry = Registry(backends, clock=lambda: self.now,
                                 adapters=[Adapter("sql", BASE, "/a/sql")])  # fmt: skip
        for b in IDS:
            self.registry.probe_result(b, True)
            self.registry.adapters.learned(b, BASE, {}, 2, read_at=0.0)
        self.orders: list[LoadOrder] = []
        self.router = Router(self.registry, make_policy("roundrobin"), clock=lambda: self.now,
                             lora=LoraSettings(load_timeout=load_timeout),
                             start_load=self.orders.append)  # fmt: skip
        self.answers: dict[str, Any] = {}

    def route(self, rid: str, model: str = "sql") -> Any:
        def reply(msg: object) -> None:
            self.answers[rid] = msg

        return self.router.route(RouteRequest(rid, RequestShape(model)), reply=reply)

    def delivered(self) -> dict[str, Any]:
        return {a.request_id: (a.decision, a.reply) for a in self.router.dequeue()}


def test_requests_for_an_adapter_nobody_holds_wait_for_one_load_then_go_where_it_is() -> None:
    f = Fleet()
    home = rank("sql", IDS)[0]
    assert [f.route(f"r{i}").reason for i in range(3)] == [Reason.QUEUED] * 3
    assert [(o.backend, o.adapter.name) for o in f.orders] == [(home, "sql")]  # single flight
    assert f.registry.in_flight()[home] == 3  # they count where they wait (admission sees them)
    assert f.delivered() == {}  # nothing until the load ends
    f.router.adapter_loaded(home, "sql", True)
    out = f.delivered()
    assert sorted(out) == ["r0", "r1", "r2"]
    assert all(d.backends[0].id == home for d, _ in out.values())
    assert all(reply is not None for _, reply in out.values())  # each to its own way back
    assert f.registry.snapshot.get(home).adapters == ("sql",)  # type: ignore[union-attr]
    # Held now: the next request is routed at once, to the holder only (no fallback lacks it).
    decision = f.route("r3")
    assert [b.id for b in decision.backends] == [home] and len(f.orders) == 1


def test_a_failed_load_sends_the_waiting_requests_to_another_replica() -> None:
    f = Fleet()
    home, second = rank("sql", IDS)[:2]
    assert f.route("r0").reason is Reason.QUEUED
    f.router.adapter_loaded(home, "sql", False, "404: no such path")
    assert f.delivered() == {}  # still waiting: for the load on the next replica
    assert [o.backend for o in f.orders] == [home, second]
    f.router.adapter_loaded(second, "sql", True)
    (decision, _), = f.delivered().values()
    assert decision.backends[0].id == second


def test_when_every_replica_failed_to_load_it_the_request_is_refused_saying_why() -> None:
    f = Fleet()
    f.route("r0")
    for failing in range(len(IDS)):  # each failure orders the load on the next replica
        f.router.adapter_loaded(f.orders[failing].backend, "sql", False,
                                "bad adapter_config.json")  # fmt: skip
    assert len(f.orders) == len(IDS)
    (decision, _), = f.delivered().values()
    assert not decision.backends and "bad adapter_config.json" in decision.detail


def test_a_wait_past_the_load_timeout_is_refused() -> None:
    f = Fleet(load_timeout=5.0)
    f.route("r0")
    f.now = 5.0
    (decision, _), = f.delivered().values()
    assert not decision.backends and "did not load within 5 s" in decision.detail
    assert f.registry.in_flight_total() == 0


def test_an_adapter_request_never_uses_a_speculative_pairing() -> None:
    f = Fleet()
    home = rank("sql", IDS)[0]
    f.registry.adapters.residency.touch(home, "sql", 0.0)
    request = RouteRequest("r0", RequestShape("sql", spec_eligible=True))
    steered = f.router.adapters.steer(request, 0.0, resume=False)
    assert steered is not None and not isinstance(steered, Reason)
    assert steered.request.shape.spec_eligible is False  # type: ignore[union-attr]


def test_the_base_model_is_routed_as_before() -> None:
    f = Fleet()
    assert f.route("r0", BASE).reason is not Reason.QUEUED and f.orders == []


def test_a_request_that_waited_in_its_band_then_waits_for_its_load_is_answered_once() -> None:
    now = [0.0]
    b0 = Backend(BackendId("b0"), "http://127.0.0.1:9/b0", BASE)
    registry = Registry([b0], clock=lambda: now[0], adapters=[Adapter("sql", BASE, "/a/sql")])
    registry.probe_result("b0", True)
    registry.adapters.learned("b0", BASE, {}, 2, read_at=0.0)
    orders: list[LoadOrder] = []
    router = Router(registry, make_policy("roundrobin"), clock=lambda: now[0],
                    admission=AdmissionSettings(backend_capacity=1, headroom=0.0),
                    start_load=orders.append)  # fmt: skip
    sent: list[tuple[str, Reason]] = []
    assert router.route(RouteRequest("r0", RequestShape(BASE))).backends  # the one slot
    reply = lambda d: sent.append(("r1", d))  # noqa: E731
    assert router.route(RouteRequest("r1", RequestShape("sql")), reply=reply).reason \
        is Reason.QUEUED  # full: it waits in its band
    router.finished([RequestOutcome(request_id="r0", backend_id="b0", model=BASE, ok=True,
                                    http_status=200)])  # fmt: skip
    answers = router.dequeue()  # its turn: it now waits for the adapter's load
    assert [(a.request_id, a.decision.reason, a.reply) for a in answers] == [
        ("r1", Reason.QUEUED, reply)]
    assert [(o.backend, o.adapter.name) for o in orders] == [("b0", "sql")]
    router.adapter_loaded("b0", "sql", True)
    (answer,) = router.dequeue()
    assert answer.request_id == "r1" and answer.reply is reply
    assert [b.id for b in answer.decision.backends] == ["b0"]


def test_an_adapter_with_a_request_in_flight_is_never_unloaded_for_another() -> None:
    now = [0.0]
    b0 = Backend(BackendId("b0"), "http://127.0.0.1:9/b0", BASE)
    registry = Registry([b0], clock=lambda: now[0],
                        adapters=[Adapter("sql", BASE, "/a/sql"), Adapter("law", BASE, "/a/l")])
    registry.probe_result("b0", True)
    registry.adapters.learned("b0", BASE, {"sql": "/a/sql"}, 1, read_at=0.0)  # full
    orders: list[LoadOrder] = []
    router = Router(registry, make_policy("roundrobin"), clock=lambda: now[0],
                    lora=LoraSettings(min_idle=0.0), start_load=orders.append)  # fmt: skip
    assert [b.id for b in router.route(RouteRequest("r1", RequestShape("sql"))).backends] == [
        "b0"]
    now[0] = 100.0  # long idle by the clock, but r1 has not ended
    router.route(RouteRequest("r2", RequestShape("law")), reply=lambda _: None)
    assert [o.evict for o in orders] == [()]  # loaded beside it, not in its place
    assert registry.adapters.held("b0") == ("sql",)
    router.adapter_loaded("b0", "law", True)
    router.finished([RequestOutcome(request_id="r1", backend_id="b0", model="sql", ok=True,
                                    http_status=200)])  # fmt: skip
    router.finished([RequestOutcome(request_id="r2", backend_id="b0", model="law", ok=True,
                                    http_status=200)])  # fmt: skip
    registry.adapters.learned("b0", BASE, {"sql": "/a/sql", "law": "/a/l"}, 1, read_at=100.0)
    now[0] = 101.0
    registry.adapters.declare(Adapter("tax", BASE, "/a/t"))
    router.route(RouteRequest("r5", RequestShape("tax")), reply=lambda _: None)
    assert orders[-1].adapter.name == "tax" and orders[-1].evict  # idle ones go now
    assert not set(orders[-1].evict) & set(registry.adapters.held("b0"))  # off routing at once
