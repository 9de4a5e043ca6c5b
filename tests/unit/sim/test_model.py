from __future__ import annotations

from random import Random

from sim.generation import Sequence
from sim.model import ModelConfig, ToyModel
from sim.protocol import SamplingParams
from sim.tokenizer import EOS, build_tokenizer

TOK = build_tokenizer()
PROMPT = TOK.encode("<|bos|><|user|>What does a router do?<|end|><|assistant|>")


def greedy(model: ToyModel, history: list[int], n: int) -> list[int]:
    seq = Sequence(model, history, SamplingParams(max_tokens=n))
    while not seq.finished:
        seq.step()
    return seq.token_ids


def test_greedy_is_deterministic_and_text_like() -> None:
    a = greedy(ToyModel(ModelConfig(seed=3), TOK), PROMPT, 200)
    b = greedy(ToyModel(ModelConfig(seed=3), TOK), PROMPT, 200)
    assert a == b
    text = TOK.decode(a)
    assert text.isascii() and " " in text
    assert len(set(a)) > 40  # not one token repeated
    assert EOS not in a  # eos_rate 0: runs to max_tokens


def test_model_seed_and_prompt_change_the_output() -> None:
    base = greedy(ToyModel(ModelConfig(seed=0), TOK), PROMPT, 32)
    assert greedy(ToyModel(ModelConfig(seed=1), TOK), PROMPT, 32) != base
    other = TOK.encode("<|bos|><|user|>What does a switch do?<|end|><|assistant|>")
    assert greedy(ToyModel(ModelConfig(seed=0), TOK), other, 32) != base


def test_resume_from_any_prefix_gives_exactly_the_remaining_tokens() -> None:
    model = ToyModel(ModelConfig(seed=0), TOK)
    full = greedy(model, PROMPT, 100)
    for k in (0, 1, 7, 50, 99):
        assert greedy(model, PROMPT + full[:k], 100 - k) == full[k:]


def test_candidates_top1_is_greedy_and_top2_differs() -> None:
    model = ToyModel(ModelConfig(seed=0, tie_rate=0.3, chip_seed=5), TOK)
    h, last = model.start(PROMPT), PROMPT[-1]
    for tok in greedy(model, PROMPT, 200):
        cands = model.candidates(h, last, k=5)
        assert cands.ids[0] == model.greedy(h, last) == tok
        assert len(set(cands.ids)) == 5
        h, last = model.advance(h, tok), tok


def test_chips_disagree_only_at_near_tie_positions() -> None:
    a = ToyModel(ModelConfig(seed=0, chip_seed=1, tie_rate=0.1), TOK)
    b = ToyModel(ModelConfig(seed=0, chip_seed=2, tie_rate=0.1), TOK)
    h, last = a.start(PROMPT), PROMPT[-1]
    ties = disagreements = 0
    for tok in greedy(a, PROMPT, 2000):
        tie = a.near_tie(h)
        assert tie == b.near_tie(h)  # ties are a property of the weights
        if a.greedy(h, last) != b.greedy(h, last):
            assert tie
            disagreements += 1
        ties += tie
        h, last = a.advance(h, tok), tok
    assert 100 < ties < 300  # ~10%
    assert ties * 0.3 < disagreements < ties * 0.7  # each chip breaks ties its own way


def test_without_tie_rate_chip_seeds_are_byte_identical() -> None:
    a = greedy(ToyModel(ModelConfig(seed=0, chip_seed=1), TOK), PROMPT, 500)
    b = greedy(ToyModel(ModelConfig(seed=0, chip_seed=2), TOK), PROMPT, 500)
    assert a == b


def test_eos_rate_ends_sequences_and_ignore_eos_overrides_it() -> None:
    model = ToyModel(ModelConfig(seed=0, eos_rate=0.05), TOK)
    seq = Sequence(model, PROMPT, SamplingParams(max_tokens=1000))
    while not seq.finished:
        seq.step()
    assert seq.finish_reason == "stop" and seq.token_ids[-1] == EOS
    assert len(seq.token_ids) < 1000
    seq = Sequence(model, PROMPT, SamplingParams(max_tokens=300, ignore_eos=True))
    while not seq.finished:
        seq.step()
    assert seq.finish_reason == "length" and EOS not in seq.token_ids


def test_sampling_is_seeded_and_respects_top_k() -> None:
    model = ToyModel(ModelConfig(seed=0), TOK)
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=42)
    runs = []
    for _ in range(2):
        seq = Sequence(model, PROMPT, params)
        while not seq.finished:
            seq.step()
        runs.append(seq.token_ids)
    assert runs[0] == runs[1]
    assert runs[0] != greedy(model, PROMPT, 64)
    other = Sequence(model, PROMPT, params, index=1)  # n>1: seed + index
    while not other.finished:
        other.step()
    assert other.token_ids != runs[0]
    h, last = model.start(PROMPT), PROMPT[-1]
    rng = Random(0)
    top3 = set(model.candidates(h, last, k=3).ids)
    picks = {model.sample(h, last, rng, temperature=5.0, top_k=3) for _ in range(200)}
    assert picks <= top3 and len(picks) > 1
    only_top = {model.sample(h, last, rng, temperature=1.0, top_p=0.01) for _ in range(50)}
    assert only_top == {model.greedy(h, last)}
