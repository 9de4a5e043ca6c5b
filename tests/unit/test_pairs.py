"""Pairs, facts and the post-failover gate: the pure rules, and the pair flow over a registry."""

from __future__ import annotations

import pytest

from baton.model import Backend, Pairing, PairState, RequestShape, Role, Verdict
from control.audit.log import EventQuery
from control.audit.payloads import EventKind
from control.exceptions import FactsError, PairExists, PairRefused
from control.fleet.registry import Registry
from control.pairs.flow import PairFlow
from control.pairs.table import PROBATION_ROUNDS, gate
from control.signals.facts import (
    Facts,
    Sweep,
    block_size_from_metrics,
    chunk_with_separator,
    describe,
    pair_violations,
)
from tests.factories import backend

GREEDY = Facts("sha256:v", 300, 16)
# The same engine, applying other sampling params than the pair was bound under.
SAMPLING = Facts("sha256:v", 300, 16, params_hash="sha256:older")
OTHER_TOKENIZER = Facts("sha256:w", 300, 16)  # one merge apart: the same vocab size
SHAPE = RequestShape("m", spec_eligible=True, greedy=True, sets_temperature=True)


def registry() -> tuple[Registry, PairFlow]:
    reg = Registry(
        [backend("t0"), backend("t1"), backend("t2"), backend("d", Role.DRAFT)], clock=lambda: 1.0
    )
    reg.set_facts("t1", OTHER_TOKENIZER)
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


# What vLLM 0.32 publishes on /metrics (one line per engine core), its labels trimmed.
CACHE_INFO = (
    'vllm:cache_config_info{{block_size="{size}",cache_dtype="auto",'
    'enable_prefix_caching="True",engine="{engine}",num_gpu_blocks="8192"}} 1.0\n'
)
VLLM_METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    + CACHE_INFO.format(size=128, engine=0)
    + CACHE_INFO.format(size=128, engine=1)
    + 'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
)


def test_the_block_size_is_read_from_vllms_cache_config_info() -> None:
    assert block_size_from_metrics(VLLM_METRICS) == 128
    with pytest.raises(FactsError, match="no vllm:cache_config_info"):
        block_size_from_metrics("vllm:num_requests_running 0.0\n")
    other = VLLM_METRICS.replace(CACHE_INFO.format(size=128, engine=1),
                                 CACHE_INFO.format(size=16, engine=1))  # fmt: skip
    with pytest.raises(FactsError, match=r"\[16, 128\]"):
        block_size_from_metrics(other)


def test_the_fingerprint_changes_with_any_text_any_cut_and_the_vocab_size() -> None:
    def sweep(**change: object) -> str:
        s = Sweep(vocab_size=300, separator=10, chunks=[("a\nb\n", [97, 10, 98, 10])],
                  probes=[([104, 105], ["h", "i"])])  # fmt: skip
        for k, v in change.items():
            setattr(s, k, v)
        return s.fingerprint()

    base = sweep()
    assert base == sweep() and base.startswith("sha256:")
    assert sweep(vocab_size=301) != base  # one added token
    assert sweep(chunks=[("a\nc\n", [97, 10, 99, 10])]) != base  # one token's text
    assert sweep(chunks=[("a\nb\n", [97, 10, 300])]) != base  # the same texts, cut otherwise
    assert sweep(probes=[([104, 105], ["h", "Ġi"])]) != base  # another token string
    assert chunk_with_separator(5, 8, 10) == [5, 10, 6, 10, 7, 10]


def test_every_violation_is_named() -> None:
    other = Facts("sha256:b", 301, 32, params_hash="sha256:older")
    assert [v.invariant for v in pair_violations(GREEDY, other)] == [
        "tokenizer", "block_size", "params_hash",
    ]  # fmt: skip
    (one,) = pair_violations(GREEDY, OTHER_TOKENIZER)
    assert "the same vocab_size" in one.detail
    no_blocks = Facts("sha256:v", 300, None)  # llama-server: no paged KV cache
    assert describe(pair_violations(GREEDY, no_blocks)) == "block_size: 16 != none"
    assert pair_violations(GREEDY, GREEDY) == []
    llama = Facts("sha256:v", 300, None, engine="openai")
    assert [v.invariant for v in pair_violations(llama, llama)] == ["engine"]


def test_bind_refuses_mismatches_roles_and_a_second_binding() -> None:
    flow = PairFlow(Registry([backend("t0"), backend("d", Role.DRAFT)], clock=lambda: 1.0))
    with pytest.raises(PairRefused, match="params_hash"):
        flow.bind_pair("d", "t0", 4, GREEDY, SAMPLING)
    with pytest.raises(PairRefused, match="role"):
        flow.bind_pair("t0", "d", 4, GREEDY, GREEDY)
    flow.bind_pair("d", "t0", 4, GREEDY, GREEDY)
    with pytest.raises(PairExists):
        flow.bind_pair("d", "t0", 4, GREEDY, GREEDY)


def pairing_for(flow: PairFlow, primary: Backend, shape: RequestShape) -> Pairing | None:
    """As the router asks it: the intent decided, then applied by commit."""
    intent = flow.pairing_for(primary, shape)
    flow.apply(intent)
    return intent.pairing


def test_pairing_for_writes_nothing_until_its_intent_is_applied() -> None:
    reg, flow = registry()
    reg.drain("t2")
    target_dies(reg)
    flow.repair("d", "t1", failed_id="t0")
    flow.gate_pairing("d", "t1", 4, 4, OTHER_TOKENIZER)  # detached: no target matches
    reg.undrain("t2")
    before, events = flow.get("d"), len(pair_actions(reg))
    intent = flow.pairing_for(backend("t2"), SHAPE)
    assert intent.adopt is not None and intent.pairing is not None
    assert flow.get("d") == before and len(pair_actions(reg)) == events
    flow.apply(intent)
    after = flow.get("d")
    assert after is not None and after.target_id == "t2" and len(pair_actions(reg)) == events + 1


def test_only_spec_eligible_greedy_requests_get_the_pairing() -> None:
    _, flow = registry()
    t0 = backend("t0")
    assert pairing_for(flow, t0, SHAPE) is not None
    # A temperature left to the engine's generation config: the pair cannot know it.
    default = RequestShape("m", greedy=True, spec_eligible=True, sets_temperature=False)
    assert pairing_for(flow, t0, default) is None
    assert pairing_for(flow, t0, RequestShape("m", spec_eligible=False)) is None
    sampled = RequestShape("m", greedy=False, spec_eligible=True, sets_temperature=True)
    assert pairing_for(flow, t0, sampled) is None
    assert pairing_for(flow, backend("t2"), SHAPE) is None  # not this pair's target


@pytest.mark.parametrize(("facts", "invariant"),
                         [(OTHER_TOKENIZER, "tokenizer"), (SAMPLING, "params_hash")])  # fmt: skip
def test_failover_to_other_facts_is_rejected_and_rebound_to_a_matching_target(
    facts: Facts, invariant: str
) -> None:
    reg, flow = registry()
    flow.spec_outcome("d", "t0", 10, 40, 16)  # paired baseline 0.4
    target_dies(reg)
    pairing = flow.repair("d", "t1", failed_id="t0")
    assert pairing is not None and pairing.gate_required
    result = flow.gate_pairing("d", "t1", 4, 4, facts)  # the spike: 1.0
    assert result.verdict is Verdict.REJECT and invariant in result.reason
    assert result.target is not None and result.target.id == "t2"
    pair = flow.get("d")
    assert pair is not None and pair.target_id == "t2" and pair.state is PairState.PROBATION
    assert ("reject", "t1") in pair_actions(reg) and ("rebind", "t2") in pair_actions(reg)
    # A late probe from another request on t1 is answered with where the pair went.
    late = flow.gate_pairing("d", "t1", 4, 4, facts)
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
    result = flow.gate_pairing("d", "t1", 4, 4, OTHER_TOKENIZER)
    assert result.verdict is Verdict.REJECT and result.target is None
    pair = flow.get("d")
    assert pair is not None and pair.state is PairState.DETACHED
    assert pairing_for(flow, backend("t1"), SHAPE) is None  # never adopts other facts
    reg.undrain("t2")
    pairing = pairing_for(flow, backend("t2"), SHAPE)
    assert pairing is not None and pairing.gate_required
    (repair,) = [e for e in reg.events.query(EventQuery("pair")) if e.data["target"] == "t2"]
    assert repair.data["action"] == "repair" and repair.data["previous"] == "t1"
