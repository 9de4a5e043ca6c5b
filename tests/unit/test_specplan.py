"""Judging a speculative round and the loop detector (dataplane/spec/plan.py)."""

from __future__ import annotations

from typing import Any

import pytest

from dataplane.request import ClientRequest, Endpoint
from dataplane.spec.plan import Judged, judge, next_k, repeated_ngram, spec_eligible


def own(*tokens: int | None, stop_at: int | None = None) -> list[tuple[int | None, str | None]]:
    """The target's one-token answers after each prefix of the draft: its greedy token, and
    "stop" at `stop_at` (its next token ends the sequence; vLLM may leave the id out)."""
    return [(None, "stop") if i == stop_at else (t, "length") for i, t in enumerate(tokens)]


def test_accepts_the_agreeing_prefix_then_takes_the_targets_own_token() -> None:
    j = judge([5, 6, 7, 8], own(5, 6, 4, 8, 3), remaining=100)
    assert j.accepted == 2 and j.emitted == (5, 6, 4) and j.finished is None


def test_all_accepted_adds_the_bonus_token() -> None:
    j = judge([5, 6], own(5, 6, 7), remaining=100)
    assert j.accepted == 2 and j.emitted == (5, 6, 7)


def test_end_of_sequence_and_length_end_the_output() -> None:
    assert judge([5], own(None, None, stop_at=0), 100) == Judged(0, (), "stop")
    drafted_past_the_end = judge([5, 6, 7], own(5, None, 1, 2, stop_at=1), 100)
    assert drafted_past_the_end == Judged(1, (5,), "stop")
    after_all = judge([5], own(5, None, stop_at=1), 100)
    assert after_all.emitted == (5,) and after_all.finished == "stop"
    capped = judge([5, 6, 7], own(5, 6, 7, 8), 2)
    assert capped.emitted == (5, 6) and capped.finished == "length"


def test_answers_that_do_not_fit_the_draft_are_refused() -> None:
    with pytest.raises(ValueError, match="3 target answers for a draft of 1"):
        judge([5], own(5, 6, 7), 100)
    with pytest.raises(ValueError, match="no token after 1"):
        judge([5, 6], [(5, "length"), (None, "length"), (7, "length")], 100)


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


def test_adaptive_k_lengthens_after_a_whole_take_and_shortens_after_a_cut() -> None:
    assert next_k(4, drafted=4, accepted=4, most=8) == 6
    assert next_k(7, drafted=7, accepted=7, most=8) == 8  # never past the most
    assert next_k(4, drafted=4, accepted=2, most=8) == 3
    assert next_k(1, drafted=1, accepted=0, most=8) == 1  # never below one
    # A proposal cut short by the draft's end of sequence, taken whole: still a whole take.
    assert next_k(4, drafted=2, accepted=2, most=8) == 6
    # An empty proposal (the draft ended at once) earns no longer round.
    assert next_k(4, drafted=0, accepted=0, most=8) == 3
