"""Discovery's planner (control/discovery/plan.py): a source's endpoints against the
backends it added, as actions; and the registry's side of it (control/fleet/sources.py): a
discovered backend is never configuration."""

from __future__ import annotations

import pytest

from baton.model import Backend, BackendId, BackendStatus, Health, HealthState
from control.audit.log import EventQuery
from control.discovery.endpoints import Phase
from control.discovery.plan import Add, Drain, Refuse, Remove, Undrain, Wanted, plan, reasons
from control.fleet.db import Configured
from control.pairs.flow import PairFlow
from control.replicas.reconcile import reconcile
from tests.factories import registry

SRC = "k8s:llm/vllm"
NOT_READY, TERMINATING, GONE = reasons(SRC)


def engine(bid: str, port: int = 8000, model: str = "m") -> Backend:
    return Backend(BackendId(bid), f"http://10.0.0.{len(bid)}:{port}", model)


def held(bid: str, state: HealthState = HealthState.HEALTHY, reason: str = "",
         migrating: bool = False, source: str = SRC, port: int = 8000,
         ) -> BackendStatus:  # fmt: skip
    return BackendStatus(engine(bid, port), Health(state, reason, 0.0), migrating, source=source)


DRAINING = HealthState.DRAINING
R, NR, T = Phase.READY, Phase.NOT_READY, Phase.TERMINATING

CASES = [
    # (what the source sees, what the registry holds, what to do)
    ("a ready endpoint joins", {"p": Wanted(R, engine("p"))}, [], [Add(engine("p"))]),
    ("not before its model is known", {"p": Wanted(R, None)}, [], []),
    ("a not-ready one never joins", {"p": Wanted(NR, engine("p"))}, [], []),
    ("nor a terminating one", {"p": Wanted(T, engine("p"))}, [], []),
    # A new leader: its registry holds none of what its predecessor added.
    ("one seen ready, not ready now: joins demoted",
     {"p": Wanted(NR, engine("p"), was_ready=True)}, [],
     [Add(engine("p")), Drain("p", False, NOT_READY)]),
    ("one seen ready, terminating now: joins and its streams move",
     {"p": Wanted(T, engine("p"), was_ready=True)}, [],
     [Add(engine("p")), Drain("p", True, TERMINATING)]),
    ("seen ready, its id an operator's: refused",
     {"p": Wanted(T, engine("p"), was_ready=True)}, [held("p", source="cli")],
     [Refuse("p", "cli")]),
    ("a joined one stays", {"p": Wanted(R, engine("p"))}, [held("p")], []),
    ("not ready: demoted", {"p": Wanted(NR, engine("p"))}, [held("p")],
     [Drain("p", False, NOT_READY)]),
    ("ready again: back", {"p": Wanted(R, engine("p"))}, [held("p", DRAINING, NOT_READY)],
     [Undrain("p")]),
    ("an operator's drain stays", {"p": Wanted(R, engine("p"))},
     [held("p", DRAINING, "drained by admin")], []),
    ("terminating: its streams move", {"p": Wanted(T, engine("p"))}, [held("p")],
     [Drain("p", True, TERMINATING)]),
    ("terminating after not ready too", {"p": Wanted(T, engine("p"))},
     [held("p", DRAINING, NOT_READY)], [Drain("p", True, TERMINATING)]),
    ("moving already: nothing more", {"p": Wanted(T, engine("p"))},
     [held("p", DRAINING, TERMINATING, migrating=True)], []),
    ("gone: removed", {}, [held("p", DRAINING, TERMINATING, migrating=True)], [Remove("p")]),
    ("gone while ready: removed", {}, [held("p")], [Remove("p")]),
    ("another engine behind the id", {"p": Wanted(R, engine("p", 9000))}, [held("p")],
     [Remove("p"), Add(engine("p", 9000))]),
    ("the model unknown yet: kept", {"p": Wanted(R, None)}, [held("p")], []),
    ("an operator's backend is never touched", {}, [held("p", source="cli")], []),
    ("nor is its id taken", {"p": Wanted(R, engine("p"))}, [held("p", source="config")],
     [Refuse("p", "config")]),
    ("another source's backends are its own", {}, [held("p", source="dns:x")], []),
]  # fmt: skip


@pytest.mark.parametrize(("wanted", "fleet", "want"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_plan(wanted: dict[str, Wanted], fleet: list[BackendStatus], want: list[object]) -> None:
    assert plan(SRC, wanted, fleet, {}) == want


def test_a_dns_record_gone_drains_with_migrate_and_removes_once_idle() -> None:
    src = "dns:e"
    gone = reasons(src)[2]
    assert plan(src, {}, [held("p", source=src)], {}, linger=True) == [Drain("p", True, gone)]
    moving = held("p", DRAINING, gone, migrating=True, source=src)
    assert plan(src, {}, [moving], {BackendId("p"): 2}, linger=True) == []
    assert plan(src, {}, [moving], {}, linger=True) == [Remove("p")]
    # The record back before then: it serves again.
    assert plan(src, {"p": Wanted(R, engine("p"))}, [moving], {}, linger=True) == [Undrain("p")]


def test_discovered_backends_are_not_configuration() -> None:
    reg = registry(["a"])
    reg.add(engine("llm/p"), SRC)
    reg.drain("llm/p", True, source=SRC, reason=TERMINATING)
    reg.add(engine("b"))
    assert {s.backend.id: s.source for s in reg.snapshot.backends} == {
        "a": "config", "b": "cli", "llm/p": SRC}  # fmt: skip
    assert reg.drained() == {} and reg.discovered("llm/p") and not reg.discovered("b")
    state = reg.snapshot.get("llm/p")
    assert state is not None and state.health.reason == TERMINATING and state.migrating
    drain = reg.events.query(EventQuery(backend_id="llm/p"))[-1]
    assert drain.data["action"] == "drain" and drain.data["source"] == SRC  # who did it
    # A replica brought to the store's configuration leaves a discovered backend alone.
    reconcile(reg, PairFlow(reg), Configured(added=(engine("b"),)),
              config_backends=[reg.backend("a")])  # fmt: skip
    assert [b.id for b in reg.backends] == ["a", "b", "llm/p"]
    assert reg.snapshot.get("b").source == "cli"  # type: ignore[union-attr]
