"""Judging a speculative round and the loop detector (dataplane/spec/plan.py)."""

from __future__ import annotations

from typing import Any

from dataplane.spec.plan import judge, repeated_ngram, spec_eligible
from dataplane.validate import ClientRequest, Endpoint

EOS = 9


def scores(ctx: int, argmax: list[int]) -> list[dict[str, Any] | None]:
    """prompt_logprobs for `ctx` context tokens then the draft: rank-1 token per position."""
    entries: list[dict[str, Any] | None] = [None] + [{"1": {"rank": 1}}] * (ctx - 1)
    return entries + [{str(t): {"rank": 1, "logprob": 0.0}} for t in argmax]


def test_accepts_the_agreeing_prefix_then_takes_the_targets_own_token() -> None:
    j = judge([5, 6, 7, 8], scores(3, [5, 6, 4, 8]), bonus=[3], bonus_finish="length",
              remaining=100, eos=EOS)  # fmt: skip
    assert j.accepted == 2 and j.emitted == (5, 6, 4) and j.finished is None


def test_all_accepted_adds_the_bonus_token() -> None:
    j = judge([5, 6], scores(2, [5, 6]), bonus=[7], bonus_finish="length", remaining=100, eos=EOS)
    assert j.accepted == 2 and j.emitted == (5, 6, 7)


def test_end_of_sequence_and_length_end_the_output() -> None:
    assert judge([5], scores(1, [EOS]), [], None, 100, EOS).finished == "stop"
    eos_drafted = judge([5, EOS, 6], scores(1, [5, EOS, 6]), [7], "length", 100, EOS)
    assert eos_drafted.emitted == (5,) and eos_drafted.finished == "stop"
    bonus_eos = judge([5], scores(1, [5]), [EOS], "stop", 100, EOS)
    assert bonus_eos.emitted == (5,) and bonus_eos.finished == "stop"
    capped = judge([5, 6, 7], scores(1, [5, 6, 7]), [8], "length", 2, EOS)
    assert capped.emitted == (5, 6) and capped.finished == "length"


def test_loops_are_detected_and_ordinary_text_is_not() -> None:
    assert repeated_ngram([1, 2, 3] * 8)
    assert repeated_ngram(list(range(40)) + [7] * 8)
    assert not repeated_ngram(list(range(64)))


def test_only_plain_greedy_requests_with_a_length_cap_are_eligible() -> None:
    def req(**body: Any) -> ClientRequest:
        body = {"model": "m", "prompt": "x", **body}
        greedy = body.get("temperature") == 0
        return ClientRequest(Endpoint.COMPLETIONS, body, "m", False, greedy)

    assert spec_eligible(req(max_tokens=8, temperature=0))
    assert spec_eligible(req(max_tokens=8))  # the backend's default decides; control knows it
    assert not spec_eligible(req(temperature=0))  # no cap: the engine's default is unknown
    assert not spec_eligible(req(max_tokens=8, temperature=0.7))
    assert not spec_eligible(req(max_tokens=8, temperature=0, logprobs=2))
    assert not spec_eligible(req(max_tokens=8, temperature=0, stop=["\n"]))
    assert not spec_eligible(req(max_tokens=8, temperature=0, n=2))
    assert spec_eligible(req(max_tokens=8, temperature=0, n=1))
