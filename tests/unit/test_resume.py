from __future__ import annotations

import pytest

from baton.model import ResumePath, Seam
from dataplane.exceptions import Refused
from dataplane.relay.progress import OVERLAP_SLACK, ChoiceProgress, Held, overlap
from dataplane.relay.resume.plan import plan_resume, static_refusal
from dataplane.relay.resume.seam import HeldText, SeamCheck
from dataplane.request import ClientRequest, Endpoint

MSGS = [{"role": "user", "content": "hi"}]


def chat(**extra: object) -> ClientRequest:
    body = {"model": "m", "messages": MSGS, "stream": True, "temperature": 0, **extra}
    return ClientRequest(Endpoint.CHAT, body, "m", True, body.get("temperature") == 0)


def comp(prompt: object = "once", **extra: object) -> ClientRequest:
    body = {"model": "m", "prompt": prompt, "stream": True, "temperature": 0, **extra}
    return ClientRequest(Endpoint.COMPLETIONS, body, "m", True, body.get("temperature") == 0)


def progress(
    chunks: list[tuple[list[int], str]], prompt: list[int] | None = (1, 2)
) -> ChoiceProgress:  # type: ignore[assignment]
    p = ChoiceProgress(0, list(prompt) if prompt is not None else None)
    for ids, text in chunks:
        p.add(text, ids)
    return p


ONE_PER_CHUNK = [([10 + i], f"t{i}") for i in range(8)]


def test_token_plan_resumes_m_early_with_remaining_budget_and_same_params() -> None:
    p = progress(ONE_PER_CHUNK)
    plan = plan_resume(
        chat(max_tokens=20, top_k=5, stop_token_ids=[9]), p, token_path=True, seam_tokens=4
    )
    assert plan.path is ResumePath.TOKEN and plan.endpoint is Endpoint.COMPLETIONS
    assert list(plan.body["prompt"]) == [1, 2, 10, 11, 12, 13]
    assert plan.body["max_tokens"] == 20 - 4
    assert plan.body["top_k"] == 5 and plan.body["stop_token_ids"] == [9]
    assert plan.body["return_token_ids"] is True and plan.body["stream"] is True
    assert "messages" not in plan.body
    assert plan.overlap_ids == (14, 15, 16, 17) and plan.overlap_text == "t4t5t6t7"
    assert plan.seam is Seam.VERIFIED


def test_exact_plan_has_no_overlap() -> None:
    plan = plan_resume(
        chat(max_tokens=20), progress(ONE_PER_CHUNK), token_path=True, seam_tokens=4, exact=True
    )
    assert list(plan.body["prompt"]) == [1, 2, *range(10, 18)] and plan.body["max_tokens"] == 12
    assert plan.overlap_ids == () and plan.seam is Seam.UNCHECKED


def test_sampled_and_stop_strings_skip_the_check() -> None:
    sampled = plan_resume(
        chat(temperature=0.7, seed=3), progress(ONE_PER_CHUNK), token_path=True, seam_tokens=4
    )
    assert sampled.seam is Seam.SAMPLED and sampled.overlap_ids == () and sampled.body["seed"] == 3
    stops = plan_resume(chat(stop=["x"]), progress(ONE_PER_CHUNK), token_path=True, seam_tokens=4)
    # With stop strings the engine held text back: the resume's text is derived from all the
    # ids, and Baton matches the stop strings (the engine would see only its own text).
    assert stops.seam is Seam.UNCHECKED and stops.held is not None
    assert stops.held.ids == tuple(range(10, 18)) and stops.held.sent == "t0t1t2t3t4t5t6t7"
    assert "stop" not in stops.body


def test_overlap_starts_at_a_settled_boundary() -> None:
    # Chunk 3 released no text (held back): the overlap may not start right after it.
    p = progress([([1], "a"), ([2], "b"), ([3], ""), ([4], "cd"), ([5], "e")])
    assert overlap(p, 2) == (3, "cde")
    # A chunk of several tokens proves no boundary (its last tokens may be half a
    # character the engine held back): the overlap goes back to one that does.
    q = progress([([1, 2], "ab"), ([3, 4, 5], "cde")])
    assert overlap(q, 2) == (5, "abcde")
    assert overlap(q, 4) == (5, "abcde")
    assert overlap(q, 0) == (0, "")
    # No boundary within OVERLAP_SLACK tokens of m: no overlap at a boundary (the plan
    # checks the last m ids alone: each overlap token costs the new engine a decode step).
    far = progress([(list(range(2 + OVERLAP_SLACK + 1)), "x" * 10)])
    assert overlap(far, 2) == (0, "")
    near = progress([(list(range(2 + OVERLAP_SLACK)), "x" * 10)])
    assert overlap(near, 2) == (2 + OVERLAP_SLACK, "x" * 10)


def test_held_tokens_past_the_last_boundary() -> None:
    # "é" as two byte tokens: the engine released nothing with the first (half a character).
    p = progress([([1], "a"), ([0xC3], ""), ([0xA9], "é"), ([0xE4], "")])
    assert p.held() == Held((0xE4,), "")
    # An exact resume past the boundary derives its text; an overlap starts at a boundary.
    exact = plan_resume(chat(max_tokens=9), p, token_path=True, seam_tokens=4, exact=True)
    assert exact.held == Held((0xE4,), "") and exact.body["prompt"][-1] == 0xE4
    inline = plan_resume(chat(max_tokens=9), p, token_path=True, seam_tokens=2)
    assert inline.held is None and inline.overlap_ids == (0xC3, 0xA9, 0xE4)
    assert inline.overlap_text == "é" and list(inline.body["prompt"]) == [1, 2, 1]
    assert progress([([1], "a"), ([2], "b")]).held() is None


def test_far_from_a_boundary_the_overlap_is_checked_by_its_ids() -> None:
    # Chunks of three ids (vLLM's stream_interval, or a loaded engine) prove no boundary
    # after the first chunk: the last m ids are regenerated and compared as ids, and the
    # text since the boundary is derived from ids.
    chunks = [([7], "a")] + [([10 + 3 * i, 11 + 3 * i, 12 + 3 * i], f"w{i}") for i in range(30)]
    p = progress(chunks)
    plan = plan_resume(chat(max_tokens=200), p, token_path=True, seam_tokens=4)
    assert plan.seam is Seam.VERIFIED and not plan.overlap_has_text
    assert plan.overlap_ids == tuple(p.token_ids[-4:]) and plan.overlap_tokens == 4
    assert list(plan.body["prompt"]) == [1, 2, *p.token_ids[:-4]]
    assert plan.body["max_tokens"] == 200 - (len(p.token_ids) - 4)
    assert plan.held == Held(tuple(p.token_ids[1:]), p.text[1:])
    # Too little generated to resume m early: nothing to check.
    short = plan_resume(chat(), progress([([1, 2, 3], "ab")]), token_path=True, seam_tokens=4)
    assert short.seam is Seam.UNCHECKED and short.overlap_ids == ()


def test_an_ids_only_overlap_is_judged_by_its_ids() -> None:
    check = SeamCheck((5, 6), "")
    assert check.feed([5], "\ufffdx", False) is None and check.verdict is None
    assert check.feed([6, 9], "yz", False) == ([9], "\ufffdxyz")
    assert check.verdict is Seam.VERIFIED
    wrong = SeamCheck((5, 6), "")
    assert wrong.feed([5, 7], "", False) is None and wrong.verdict is Seam.DIVERGENT


def test_held_text_is_derived_from_ids_once_whole() -> None:
    held = HeldText(Held((0xE4,), ""))
    held.add([0xB8])
    assert held.resolve("\ufffd", False) is None  # still half a character: nothing yet
    held.add([0xAD, 0x41])
    assert held.resolve("中A", False) == "中A" and held.verdict is None
    # What the client has must be a prefix of the decoded text, or the seam is divergent.
    other = HeldText(Held((0x41, 0xE4), "A"))
    assert other.resolve("B中", False) is not None and other.verdict is Seam.DIVERGENT
    # At the end, what the caller passes is final even with a U+FFFD at its end.
    assert HeldText(Held((0x80,), "")).resolve("\ufffd", True) == "\ufffd"


def test_text_path_for_chat_and_completions() -> None:
    p = progress([([], "Hello"), ([], " wor")], prompt=None)
    plan = plan_resume(chat(max_tokens=10), p, token_path=True, seam_tokens=4)
    assert plan.path is ResumePath.TEXT and plan.endpoint is Endpoint.CHAT
    assert plan.body["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
    assert plan.body["continue_final_message"] is True
    assert plan.body["add_generation_prompt"] is False
    assert plan.body["max_tokens"] == 8 and plan.body["n"] == 1
    c = plan_resume(comp("Say:"), p, token_path=False, seam_tokens=4)
    assert c.body["prompt"] == "Say:Hello wor" and c.endpoint is Endpoint.COMPLETIONS
    with pytest.raises(Refused):
        plan_resume(comp([5, 6, 7]), p, token_path=False, seam_tokens=4)


def test_client_prefill_is_extended_not_duplicated() -> None:
    msgs = [*MSGS, {"role": "assistant", "content": "Sure: "}]
    req = chat(messages=msgs, continue_final_message=True, add_generation_prompt=False)
    plan = plan_resume(req, progress([([], "yes")], prompt=None), token_path=False, seam_tokens=0)
    assert plan.body["messages"][-1]["content"] == "Sure: yes"
    assert len(plan.body["messages"]) == 2


def test_nothing_sent_restarts_the_request() -> None:
    plan = plan_resume(chat(max_tokens=7), ChoiceProgress(0), token_path=True, seam_tokens=4)
    assert plan.endpoint is Endpoint.CHAT and plan.body["messages"] == MSGS
    assert plan.body["max_tokens"] == 7


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"guided_json": {"type": "object"}}, "guided"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "JSON"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
    ],
)
def test_refusals_name_the_reason(extra: dict[str, object], words: str) -> None:
    assert words in (static_refusal(chat(**extra).body) or "")
    with pytest.raises(Refused, match=words):
        plan_resume(chat(**extra), progress(ONE_PER_CHUNK), token_path=True, seam_tokens=4)


def test_tool_call_in_flight_is_refused() -> None:
    p = progress(ONE_PER_CHUNK)
    p.tool_call = True
    with pytest.raises(Refused, match="tool call"):
        plan_resume(chat(), p, token_path=True, seam_tokens=4)


def test_zero_penalties_are_fine() -> None:
    assert static_refusal(chat(frequency_penalty=0, presence_penalty=0.0).body) is None


def test_seam_check_verified_drops_the_overlap_across_chunk_boundaries() -> None:
    check = SeamCheck((14, 15), "t4t5")
    assert check.feed([14], "t4", False) is None and check.verdict is None
    assert check.feed([15, 16], "t5t6", False) == ([16], "t6")
    assert check.verdict is Seam.VERIFIED
    assert check.feed([17], "t7", False) == ([17], "t7")


def test_seam_check_waits_for_held_back_text() -> None:
    check = SeamCheck((14,), "é")
    assert check.feed([14], "", False) is None  # incomplete UTF-8 held back
    assert check.feed([15], "éx", False) == ([15], "x")


def test_seam_check_divergent() -> None:
    check = SeamCheck((14, 15), "t4t5")
    assert check.feed([14], "t4", False) is None
    assert check.feed([99], "zz", False) is None
    assert check.verdict is Seam.DIVERGENT
    early = SeamCheck((14, 15), "t4t5")
    assert early.feed([14], "t4", True) is None and early.verdict is Seam.DIVERGENT


def test_no_overlap_is_unchecked_pass_through() -> None:
    check = SeamCheck((), "")
    assert check.verdict is Seam.UNCHECKED
    assert check.feed([1], "a", False) == ([1], "a")


def test_a_greedy_text_resume_starts_m_chunks_early_and_checks_them_by_text() -> None:
    p = progress([([], "Hel"), ([], "lo"), ([], " wo"), ([], "rl"), ([], "d!")], prompt=None)
    plan = plan_resume(comp("Say:", max_tokens=10), p, token_path=False, seam_tokens=2)
    assert plan.seam is Seam.VERIFIED and plan.overlap_text == "rld!" and plan.overlap_ids == ()
    assert plan.body["prompt"] == "Say:Hello wo" and plan.overlap_tokens == 2
    assert plan.body["max_tokens"] == 10 - 5 + 2  # the overlap is generated again
    exact = plan_resume(comp("Say:", max_tokens=10), p, token_path=False, seam_tokens=2,
                        exact=True)  # fmt: skip
    assert exact.seam is Seam.UNCHECKED and exact.body["prompt"] == "Say:Hello world!"
    check = SeamCheck(plan.overlap_ids, plan.overlap_text)
    assert check.feed([], "rl", False) is None  # still inside the overlap
    assert check.feed([], "d! next", False) == ([], " next") and check.verdict is Seam.VERIFIED
    drift = SeamCheck((), "rld!")
    assert drift.feed([], "rle", False) is None and drift.verdict is Seam.DIVERGENT


def test_text_verdicts_of_a_side_check() -> None:
    from dataplane.relay.resume.sidecheck import text_verdict

    assert text_verdict("rld!", "rld!") is Seam.VERIFIED
    assert text_verdict("rl", "rld!") is Seam.UNCHECKED  # fewer chunks than tokens: no proof
    assert text_verdict("rle!", "rld!") is Seam.DIVERGENT
