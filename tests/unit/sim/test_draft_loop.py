"""The toy model's draft role and degenerate (looping) mode."""

from __future__ import annotations

from random import Random

import pytest

from sim.model import ModelConfig, ToyModel
from sim.tokenizer import EOS, build_tokenizer
from tests.factories import greedy

TOK = build_tokenizer()
PROMPT = TOK.encode("<|bos|><|user|>What does a router do?<|end|><|assistant|>")


def agreement(draft: ToyModel, target: ToyModel, n: int) -> float:
    """Fraction of positions along the target's greedy path where the draft's argmax matches."""
    h, last, same = target.start(PROMPT), PROMPT[-1], 0
    for tok in greedy(target, PROMPT, n):
        same += draft.greedy(h, last) == tok
        h, last = target.advance(h, tok), tok
    return same / n


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.6, 0.9])
def test_draft_agrees_with_the_target_at_the_configured_rate(rate: float) -> None:
    target = ToyModel(ModelConfig(seed=4), TOK)
    draft = ToyModel(ModelConfig(seed=4, draft_agree_rate=rate), TOK)
    assert agreement(draft, target, 2000) == pytest.approx(rate, abs=0.04)


def test_agree_rate_one_is_the_plain_model() -> None:
    plain = greedy(ToyModel(ModelConfig(seed=2), TOK), PROMPT, 300)
    assert greedy(ToyModel(ModelConfig(seed=2, draft_agree_rate=1.0), TOK), PROMPT, 300) == plain


def test_a_draft_disagrees_with_the_targets_runner_up_at_hash_chosen_positions() -> None:
    target = ToyModel(ModelConfig(seed=1, chip_seed=7, tie_rate=0.2), TOK)
    # Another chip, same tie rate: the draft breaks ties its own way as any replica would.
    draft = ToyModel(ModelConfig(seed=1, chip_seed=8, tie_rate=0.2, draft_agree_rate=0.5), TOK)
    twin = ToyModel(ModelConfig(seed=1, chip_seed=9, tie_rate=0.2, draft_agree_rate=0.5), TOK)
    h, last = target.start(PROMPT), PROMPT[-1]
    for tok in greedy(target, PROMPT, 500):
        if draft.draft_disagrees(h) and not target.near_tie(h):
            assert draft.greedy(h, last) == target.candidates(h, last).ids[1]
        # Where the swap happens is a property of the history, not of the replica.
        assert draft.draft_disagrees(h) == twin.draft_disagrees(h)
        h, last = target.advance(h, tok), tok


def test_draft_candidates_and_greedy_agree_and_sampling_still_works() -> None:
    draft = ToyModel(ModelConfig(seed=0, draft_agree_rate=0.4, eos_rate=0.05), TOK)
    h, last = draft.start(PROMPT), PROMPT[-1]
    rng = Random(0)
    for tok in greedy(draft, PROMPT, 300, ignore_eos=True):
        for allow_eos in (True, False):
            cands = draft.candidates(h, last, 6, allow_eos=allow_eos).ids
            assert cands[0] == draft.greedy(h, last, allow_eos=allow_eos)
            assert len(set(cands)) == 6
        assert draft.sample(h, last, rng, temperature=0.8) in draft.candidates(h, last, 20).ids
        h, last = draft.advance(h, tok), tok


def test_loop_mode_repeats_an_l_gram_after_t_tokens() -> None:
    model = ToyModel(ModelConfig(seed=0, loop_after_len=len(PROMPT) + 10, loop_period=4), TOK)
    out = greedy(model, PROMPT, 60)
    assert out[:10] == greedy(ToyModel(ModelConfig(seed=0), TOK), PROMPT, 10)  # sane until T
    assert all(out[i] == out[i - 4] for i in range(10, 60))
    assert len(set(out[10:])) <= 4


def test_loop_reads_the_prompt_when_the_period_reaches_back_into_it() -> None:
    model = ToyModel(ModelConfig(seed=0, loop_after_len=1, loop_period=len(PROMPT)), TOK)
    assert greedy(model, PROMPT, 2 * len(PROMPT)) == PROMPT + PROMPT


def test_loop_token_is_a_pure_function_of_the_history() -> None:
    model = ToyModel(ModelConfig(seed=0, loop_after_len=30, loop_period=3), TOK)
    assert model.loop_token([1] * 29) is None
    assert model.loop_token([*range(27), 7, 8, 9]) == 7
    assert ToyModel(ModelConfig(seed=0, loop_after_len=30), TOK).loops is False  # L=0: off


def test_loop_never_forces_eos_while_eos_is_suppressed() -> None:
    model = ToyModel(ModelConfig(seed=0, loop_after_len=1, loop_period=2), TOK)
    h = model.start([EOS, 65])
    assert model.greedy(h, 65, loop=EOS) == EOS
    assert model.greedy(h, 65, allow_eos=False, loop=EOS) == model.greedy(h, 65, allow_eos=False)
    assert greedy(model, [EOS, 65], 6, min_tokens=6)[1::2] == [65, 65, 65]
