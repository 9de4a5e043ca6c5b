"""The resume planner's invariants over any progress a stream can have made: the new prompt
is the prompt ids plus exactly the generated prefix the client has, the overlap is the last
m+ tokens and is respected, the remaining budget is never negative, the client's request is
never mutated, and the seam check accepts exactly a faithful regeneration."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from baton.model import ResumePath, Seam
from dataplane.exceptions import Refused
from dataplane.relay.progress import ChoiceProgress, overlap
from dataplane.relay.resume.plan import plan_resume
from dataplane.relay.resume.seam import SeamCheck
from dataplane.request import ClientRequest, Endpoint

# A stream's chunks: token ids and the text released with them ("" = held back by the engine).
chunks = st.lists(
    st.tuples(st.lists(st.integers(0, 1000), min_size=1, max_size=3), st.text(max_size=4)),
    max_size=30,
)


def progress_of(prompt_ids: list[int] | None, parts: list[tuple[list[int], str]]) -> ChoiceProgress:
    p = ChoiceProgress(0, prompt_ids)
    for ids, text in parts:
        p.add(text, ids)
    return p


@st.composite
def requests(draw: st.DrawFn, endpoint: Endpoint | None = None) -> ClientRequest:
    # The endpoints a resume is planned for (a Responses stream resumes as chat).
    endpoint = endpoint or draw(st.sampled_from([Endpoint.CHAT, Endpoint.COMPLETIONS]))
    body: dict[str, Any] = {"model": "m", "stream": True}
    if endpoint is Endpoint.CHAT:
        body["messages"] = [{"role": "user", "content": "q"}]
        if draw(st.booleans()):
            body["messages"].append({"role": "assistant", "content": draw(st.text(max_size=5))})
            body["continue_final_message"] = True
    else:
        body["prompt"] = draw(st.text(max_size=10))
    body["temperature"] = draw(st.sampled_from([0, 0.8]))
    for name, value in (
        ("max_tokens", st.integers(1, 200)),
        ("min_tokens", st.integers(0, 20)),
        ("stop", st.lists(st.text(min_size=1, max_size=3), max_size=2)),
        ("top_k", st.integers(1, 50)),
    ):
        if draw(st.booleans()):
            body[name] = draw(value)
    return ClientRequest(endpoint, body, "m", True, body["temperature"] == 0)


@given(
    requests(),
    st.lists(st.integers(0, 1000), max_size=10),
    chunks,
    st.integers(0, 8),
    st.booleans(),
)
def test_token_plan_continues_exactly_what_the_client_has(
    client: ClientRequest, prompt_ids: list[int], parts: list[tuple[list[int], str]], m: int,
    exact: bool,
) -> None:  # fmt: skip
    p = progress_of(prompt_ids, parts)
    before = copy.deepcopy(client.body)
    plan = plan_resume(client, p, token_path=True, seam_tokens=m, exact=exact)
    assert plan.path is ResumePath.TOKEN and plan.endpoint is Endpoint.COMPLETIONS
    kept = p.ids(0, len(p.token_ids) - len(plan.overlap_ids))
    assert list(plan.body["prompt"]) == prompt_ids + kept
    assert list(plan.overlap_ids) == p.ids(len(kept))
    assert plan.body["stream"] is True and plan.body["return_token_ids"] is True
    assert plan.body["n"] == 1 and plan.body["model"] == "m"
    if plan.seam is Seam.VERIFIED:
        # The overlap covers at least m tokens and its text is what the client saw for them.
        assert client.greedy and not exact and m > 0 and len(plan.overlap_ids) >= m
        assert p.text.endswith(plan.overlap_text)
    else:
        assert plan.overlap_ids == () and plan.overlap_text == ""
    if not client.greedy:
        assert plan.seam is Seam.SAMPLED
    limit = client.body.get("max_tokens")
    if limit is not None:
        assert plan.body["max_tokens"] >= 0
        if len(p.token_ids) <= limit:
            assert plan.body["max_tokens"] + len(kept) == limit
    if "min_tokens" in plan.body:
        assert 0 <= plan.body["min_tokens"] <= client.body["min_tokens"]
    assert client.body == before


@given(requests(), chunks)
def test_text_plan_carries_exactly_the_text_sent(
    client: ClientRequest, parts: list[tuple[list[int], str]]
) -> None:
    p = progress_of(None, parts)
    before = copy.deepcopy(client.body)
    plan = plan_resume(client, p, token_path=True, seam_tokens=4)  # no prompt ids: text path
    assert plan.path is ResumePath.TEXT and plan.endpoint is client.endpoint
    assert plan.overlap_ids == () and plan.body["stream"] is True and plan.body["n"] == 1
    # A greedy text resume starts a few chunks early and must regenerate them (the overlap).
    sent = "".join(t for _, t in parts)
    assert sent.endswith(plan.overlap_text)
    assert bool(plan.overlap_text) == (plan.seam is Seam.VERIFIED)
    sent = sent[: len(sent) - len(plan.overlap_text)]
    if client.endpoint is Endpoint.CHAT:
        msgs = plan.body["messages"]
        if sent or p.token_ids:
            assert msgs[-1]["role"] == "assistant" and msgs[-1]["content"].endswith(sent)
            assert plan.body["continue_final_message"] is True
            assert plan.body["add_generation_prompt"] is False
            assert len(msgs) in (len(before["messages"]), len(before["messages"]) + 1)
        else:
            assert msgs == before["messages"]
    else:
        assert plan.body["prompt"] == before["prompt"] + sent
    if "max_tokens" in plan.body and "max_tokens" in before:
        assert plan.body["max_tokens"] >= 0
    assert client.body == before


@given(chunks, st.integers(0, 10))
def test_overlap_is_a_settled_suffix_of_at_least_m_tokens(
    parts: list[tuple[list[int], str]], m: int
) -> None:
    p = progress_of([1], parts)
    n, text = overlap(p, m)
    assert 0 <= n <= len(p.token_ids)
    if n:
        assert n >= m and p.text.endswith(text)
        # It is a whole number of trailing chunks.
        sizes = [len(ids) for ids, _ in parts]
        assert any(sum(sizes[i:]) == n for i in range(len(sizes)))


@given(
    st.lists(st.integers(0, 100), min_size=1, max_size=6),
    st.lists(st.integers(0, 100), max_size=6),
    st.text(min_size=1, max_size=6),
    st.text(max_size=6),
    st.data(),
)
def test_seam_check_passes_a_faithful_regeneration_however_chunked(
    want: list[int], after: list[int], want_text: str, after_text: str, data: st.DataObject
) -> None:
    ids, text = want + after, want_text + after_text
    check = SeamCheck(tuple(want), want_text)
    cut_ids = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=4)))
    bounds = list(zip([0, *cut_ids], [*cut_ids, len(ids)], strict=True))
    out_ids: list[int] = []
    out_text = ""
    for i, (a, b) in enumerate(bounds):
        last = i == len(bounds) - 1
        piece = text if last else ""  # text may lag its tokens (held back), never lead
        if last:
            text_out = check.feed(ids[a:b], piece, True)
        else:
            text_out = check.feed(ids[a:b], piece, False)
        if text_out is not None:
            out_ids += text_out[0]
            out_text += text_out[1]
    assert check.verdict is Seam.VERIFIED
    assert out_ids == after and out_text == after_text


@given(st.lists(st.integers(0, 100), min_size=1, max_size=6), st.data())
def test_seam_check_flags_any_different_token(want: list[int], data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(want) - 1))
    other = data.draw(st.integers(0, 100))
    assume(other != want[at])
    got = [*want[:at], other, *want[at + 1 :]]
    check = SeamCheck(tuple(want), "")
    for t in got:
        if check.feed([t], "", False) is not None or check.verdict is not None:
            break
    assert check.verdict is Seam.DIVERGENT


@given(requests(), chunks)
def test_refusals_are_the_only_exception(
    client: ClientRequest, parts: list[tuple[list[int], str]]
) -> None:
    for extra in ({}, {"frequency_penalty": 0.5}, {"response_format": {"type": "json_object"}}):
        req = ClientRequest(client.endpoint, {**client.body, **extra}, "m", True, client.greedy)
        for prompt_ids in (None, [1, 2]):
            try:
                plan_resume(req, progress_of(prompt_ids, parts), token_path=True, seam_tokens=3)
            except Refused as why:
                assert extra and str(why)
