"""Pairs, facts and the post-failover gate: the pure rules, and the pair flow over a registry."""

from __future__ import annotations

import pytest

from baton.model import Backend, BackendId, PairState, RequestShape, Role, Verdict
from control.events import EventKind, EventQuery
from control.exceptions import FactsError, PairExists, PairRefused
from control.facts import Facts, Sampling, facts_from_server_info, pair_violations
from control.pairflow import PairFlow
from control.pairs import PROBATION_ROUNDS, gate
from control.registry import Registry

GREEDY = Facts("sha256:v", 16, Sampling())
SAMPLING = Facts("sha256:v", 16, Sampling(temperature=0.7))
SHAPE = RequestShape("m", spec_eligible=True, sets_temperature=False)


def backend(bid: str, role: Role = Role.SERVE) -> Backend:
    return Backend(BackendId(bid), f"http://127.0.0.1:1/{bid}", "m", role=role)


def registry() -> tuple[Registry, PairFlow]:
    reg = Registry(
        [backend("t0"), backend("t1"), backend("t2"), backend("d", Role.DRAFT)], clock=lambda: 1.0
    )
    reg.set_facts("t1", SAMPLING)
    reg.set_facts("t2", GREEDY)
    flow = PairFlow(reg)
    flow.bind_pair("d", "t0", 4, GREEDY, GREEDY)
    return reg, flow


def target_dies(reg: Registry) -> None:
    reg.report_failure("t0", "connect: refused")  # what the shim's failover reports


def pair_actions(reg: Registry) -> list[tuple[str, str]]:
    return [(e.data["action"], e.data["target"]) for e in reg.events.query(EventQuery("pair"))]


def test_gate_rejects_other_params_even_without_a_spike_and_puts_spikes_on_probation() -> None:
    assert gate(0.41, 0.94, same_params=False)[0] is Verdict.REJECT
    assert gate(0.41, 0.40, same_params=False)[0] is Verdict.REJECT  # fail closed
    assert gate(0.41, 0.94, same_params=True)[0] is Verdict.PROBATION
    assert gate(0.41, 0.50, same_params=True)[0] is Verdict.ACCEPT
    assert gate(0.41, 0.50, same_params=True, quality_ok=False)[0] is Verdict.REJECT
    verdict, reason = gate(0.41, 0.94, same_params=False)
    assert "params_hash" in reason and "0.94" in reason and "0.41" in reason


def test_facts_parse_and_every_violation_is_named() -> None:
    info = {"vocab_hash": "sha256:a", "block_size": 16, "eos_token_id": 2,
            "default_sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": -1}}  # fmt: skip
    f = facts_from_server_info(info)
    assert f.sampling.top_k == 0 and f.eos_token_id == 2  # vLLM's -1 means off, like 0
    with pytest.raises(FactsError):
        facts_from_server_info({"vocab_hash": "x"})
    other = Facts("sha256:b", 32, Sampling(temperature=0.7))
    assert [v.invariant for v in pair_violations(f, other)] == [
        "vocab_hash", "block_size", "params_hash",
    ]  # fmt: skip
    assert pair_violations(f, f) == []


def test_bind_refuses_mismatches_roles_and_a_second_binding() -> None:
    flow = PairFlow(Registry([backend("t0"), backend("d", Role.DRAFT)], clock=lambda: 1.0))
    with pytest.raises(PairRefused, match="params_hash"):
        flow.bind_pair("d", "t0", 4, GREEDY, SAMPLING)
    with pytest.raises(PairRefused, match="role"):
        flow.bind_pair("t0", "d", 4, GREEDY, GREEDY)
    flow.bind_pair("d", "t0", 4, GREEDY, GREEDY)
    with pytest.raises(PairExists):
        flow.bind_pair("d", "t0", 4, GREEDY, GREEDY)


def test_only_spec_eligible_greedy_requests_get_the_pairing() -> None:
    _, flow = registry()
    t0 = backend("t0")
    assert flow.pairing_for(t0, SHAPE) is not None  # temperature left to a greedy default
    assert flow.pairing_for(t0, RequestShape("m", spec_eligible=False)) is None
    sampled = RequestShape("m", greedy=False, spec_eligible=True, sets_temperature=True)
    assert flow.pairing_for(t0, sampled) is None
    assert flow.pairing_for(backend("t2"), SHAPE) is None  # not this pair's target


def test_failover_to_other_params_is_rejected_and_rebound_to_a_matching_target() -> None:
    reg, flow = registry()
    flow.spec_outcome("d", "t0", 10, 40, 16)  # paired baseline 0.4
    target_dies(reg)
    pairing = flow.repair("d", "t1", failed_id="t0")
    assert pairing is not None and pairing.gate_required
    result = flow.gate_pairing("d", "t1", 4, 4, SAMPLING)  # the spike: 1.0
    assert result.verdict is Verdict.REJECT and "params_hash" in result.reason
    assert result.target is not None and result.target.id == "t2"
    pair = flow.get("d")
    assert pair is not None and pair.target_id == "t2" and pair.state is PairState.PROBATION
    assert ("reject", "t1") in pair_actions(reg) and ("rebind", "t2") in pair_actions(reg)
    # A late probe from another request on t1 is answered with where the pair went.
    late = flow.gate_pairing("d", "t1", 4, 4, SAMPLING)
    assert late.verdict is Verdict.REJECT and late.target is not None and late.target.id == "t2"


def test_a_same_params_spike_is_probation_and_never_moves_the_baseline() -> None:
    reg, flow = registry()
    flow.spec_outcome("d", "t0", 10, 40, 16)
    target_dies(reg)
    flow.repair("d", "t2", failed_id="t0")
    result = flow.gate_pairing("d", "t2", 4, 4, GREEDY)
    assert result.verdict is Verdict.PROBATION
    pair = flow.get("d")
    assert pair is not None
    flow.spec_outcome("d", "t2", 10, 40, 40)  # still spiking
    assert flow.baseline(pair) == pytest.approx(0.4)
    still = flow.get("d")
    assert still is not None and still.state is PairState.PROBATION
    for _ in range(PROBATION_ROUNDS // 10 + 8):  # back in line: graduates
        flow.spec_outcome("d", "t2", 10, 40, 17)
    active = flow.get("d")
    assert active is not None and active.state is PairState.ACTIVE


def test_a_quality_signal_rejects_the_pairing() -> None:
    reg, flow = registry()
    flow.spec_outcome("d", "t0", 10, 40, 16, quality_ok=False, quality="repeated n-gram loop")
    pair = flow.get("d")
    assert pair is not None and pair.target_id == "t2"
    assert any(
        e.data.get("reason", "").startswith("quality")
        for e in reg.events.query(EventQuery(EventKind.PAIR))
    )


def test_no_matching_target_detaches_and_a_matching_one_is_adopted_later() -> None:
    reg, flow = registry()
    reg.drain("t2")
    target_dies(reg)
    flow.repair("d", "t1", failed_id="t0")
    result = flow.gate_pairing("d", "t1", 4, 4, SAMPLING)
    assert result.verdict is Verdict.REJECT and result.target is None
    pair = flow.get("d")
    assert pair is not None and pair.state is PairState.DETACHED
    assert flow.pairing_for(backend("t1"), SHAPE) is None  # never adopts other params
    reg.undrain("t2")
    pairing = flow.pairing_for(backend("t2"), SHAPE)
    assert pairing is not None and pairing.gate_required
    (repair,) = [e for e in reg.events.query(EventQuery("pair")) if e.data["target"] == "t2"]
    assert repair.data["action"] == "repair" and repair.data["previous"] == "t1"
