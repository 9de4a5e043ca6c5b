"""prompt_logprobs: scores at every prompt position, consistent with generation."""

from __future__ import annotations

import math

import pytest

from sim import responses as r
from sim.generation import Sequence
from sim.model import MAX_RANKED, ModelConfig, ToyModel
from sim.protocol import SamplingParams
from sim.scoring import prompt_logprobs, tail_rank
from sim.tokenizer import build_tokenizer

TOK = build_tokenizer()
PROMPT = TOK.encode("<|bos|><|user|>What does a router do?<|end|><|assistant|>")

MODELS = {
    "plain": ModelConfig(seed=0),
    "chip-noise": ModelConfig(seed=0, chip_seed=3, tie_rate=0.3),
    "draft": ModelConfig(seed=0, chip_seed=1, tie_rate=0.1, draft_agree_rate=0.5),
    "eos": ModelConfig(seed=5, eos_rate=0.02),
    "loop": ModelConfig(seed=0, loop_after_len=len(PROMPT) + 20, loop_period=6),
}


def generate(model: ToyModel, n: int) -> list[int]:
    seq = Sequence(model, PROMPT, SamplingParams(max_tokens=n))
    seq.run_to_end()
    return seq.token_ids


@pytest.mark.parametrize("name", MODELS)
def test_argmax_over_prompt_plus_output_is_the_greedy_output(name: str) -> None:
    model = ToyModel(MODELS[name], TOK)
    out = generate(model, 200)
    scored = prompt_logprobs(model, PROMPT + out, 2)
    for j, tok in enumerate(out, start=len(PROMPT)):
        entry = scored[j]
        assert entry is not None
        assert entry[0].rank == 1 and entry[0].token_id == tok


def test_shape_first_entry_null_top_k_then_actual_token() -> None:
    model = ToyModel(ModelConfig(seed=0), TOK)
    prompt = [*PROMPT, 300, 301]  # arbitrary ids: mostly not the argmax
    scored = prompt_logprobs(model, prompt, 3)
    assert len(scored) == len(prompt) and scored[0] is None
    for j in range(1, len(prompt)):
        entry = scored[j]
        assert entry is not None
        assert [s.rank for s in entry[:3]] == [1, 2, 3]
        by_id = {s.token_id: s for s in entry}
        assert prompt[j] in by_id
        assert len(entry) == (3 if by_id[prompt[j]].rank <= 3 else 4)
        assert all(a.logprob > b.logprob for a, b in zip(entry, entry[1:], strict=False))


def test_k_zero_gives_only_the_actual_token_with_its_true_rank() -> None:
    model = ToyModel(ModelConfig(seed=0, tie_rate=0.2, chip_seed=2), TOK)
    scored = prompt_logprobs(model, PROMPT, 0)
    full = prompt_logprobs(model, PROMPT, MAX_RANKED)
    for a, b in zip(scored[1:], full[1:], strict=True):
        assert a is not None and b is not None and len(a) == 1
        assert a[0] in b or a[0].rank > MAX_RANKED


def test_logprobs_are_a_distribution_over_the_vocabulary() -> None:
    model = ToyModel(ModelConfig(seed=0), TOK)
    ranks = range(1, TOK.vocab_size + 1)
    assert math.fsum(math.exp(model.logprob(k)) for k in ranks) == pytest.approx(1.0)
    assert model.logprob(1) - model.logprob(2) == pytest.approx(1.5)


def test_tail_ranks_follow_the_ranked_candidates_in_id_order() -> None:
    ranked = (50, 10, 30)
    assert [tail_rank(ranked, t) for t in (0, 1, 11)] == [4, 5, 14]  # 10 is ranked: skipped
    ranks = [ranked.index(t) + 1 if t in ranked else tail_rank(ranked, t) for t in range(100)]
    assert sorted(ranks) == list(range(1, 101))  # every id has its own rank


def test_wire_shape_is_vllms() -> None:
    model = ToyModel(ModelConfig(seed=0), TOK)
    wire = r.prompt_logprobs(prompt_logprobs(model, PROMPT[:3], 1), TOK.texts)
    assert wire[0] is None
    first = wire[1]
    assert first is not None and str(PROMPT[1]) in first
    entry = first[str(PROMPT[1])]
    assert set(entry) == {"logprob", "rank", "decoded_token"}
    assert entry["decoded_token"] == TOK.texts[PROMPT[1]]
