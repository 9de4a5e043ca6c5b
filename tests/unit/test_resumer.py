"""One choice's resume on one backend (dataplane/relay/resume/attempt.py, Resumer): what it
asks the new engine for, what the client gets from it, and how each way it can end is told
to the relay (a refusal, a rejection, a cut, a seam that diverged, a move). The engines are
in-process fakes over HTTP (tests/unit/relay_fakes.py); the client's stream is recorded."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from baton.model import Backend, BackendKind, Failure, ResumePath, Seam, SeamMode
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume.attempt import Resumer
from dataplane.relay.resume.reasoning import Markers
from dataplane.relay.stitch import Stitcher
from dataplane.request import Endpoint
from dataplane.settings import ResumeSettings, Timeouts
from tests.factories import client_request
from tests.unit.relay_fakes import (
    Answer,
    Client,
    FakeEngine,
    Stream,
    chat_chunk,
    chunk,
    run,
    spell,
)

INLINE = ResumeSettings(seam_mode=SeamMode.INLINE, seam_tokens=0)
PROMPT_IDS = [1, 2]
SENT = [10, 11, 12, 13, 14]  # what the first engine streamed, one token per chunk


class Down(Client):
    """The relay as a resume sees it (Downstream): the client's stream, the finished
    upstreams kept for reuse, and a migration target when `move_to` is set."""

    def __init__(self, move_to: Backend | None = None) -> None:
        super().__init__()
        self.kept: list[aiohttp.ClientResponse] = []
        self.move_to = move_to

    def keep(self, upstream: aiohttp.ClientResponse) -> None:
        self.kept.append(upstream)

    def due(self, backend_id: str) -> bool:
        return self.move_to is not None

    async def target(self, backend: Backend) -> Backend | None:
        return self.move_to


class Rig:
    def __init__(self, client: Any, settings: ResumeSettings, down: Down) -> None:
        self.client, self.settings, self.down = client, settings, down
        self.stitcher = Stitcher(client, strip_ids=not client.body.get("return_token_ids"))
        self.session = aiohttp.ClientSession()
        self.resumer = Resumer(session=self.session, timeouts=Timeouts(), settings=settings,
                               client=client, stitcher=self.stitcher, downstream=down)  # fmt: skip

    def first_stream(self, events: Sequence[dict[str, Any]]) -> ChoiceProgress:
        """What the first engine sent before it failed, through the stitcher as the relay
        feeds it; the choice's progress."""
        for event in events:
            data = orjson.dumps(event)
            _, failure = self.stitcher.original(data, b"data: " + data + b"\n\n")
            assert failure is None
        return self.stitcher.choices[0]


@asynccontextmanager
async def rig(
    settings: ResumeSettings = INLINE, down: Down | None = None, **body: object
) -> AsyncIterator[Rig]:
    endpoint = Endpoint.CHAT if "messages" in body else Endpoint.COMPLETIONS
    r = Rig(client_request(endpoint, **body), settings, down or Down())
    try:
        yield r
    finally:
        for u in r.down.kept:
            u.close()
        await r.session.close()


async def engine(kind: BackendKind = BackendKind.OPENAI, *replies: Any) -> FakeEngine:
    return (await FakeEngine("b", kind).start()).script(*replies)


def token_stream() -> list[dict[str, Any]]:
    return [chunk([t], with_ids=True, prompt_ids=PROMPT_IDS if i == 0 else None)
            for i, t in enumerate(SENT)]  # fmt: skip


def test_a_text_resume_continues_after_what_the_client_has() -> None:
    async def scenario() -> None:
        b = await engine(BackendKind.OPENAI, Stream([chunk([3]), chunk([4], finish="length")]))
        async with rig(max_tokens=4, prompt="x") as r:
            p = r.first_stream([chunk([1]), chunk([2])])
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        assert result.failure is None and result.path is ResumePath.TEXT
        assert result.seam is Seam.UNCHECKED  # nothing to check it by (seam_tokens 0)
        # The engine is asked for the rest only, after the text the client already has.
        (asked,) = b.generations
        assert asked["prompt"] == "x" + spell([1, 2]) and asked["max_tokens"] == 2
        assert r.down.text == spell([3, 4]) and r.down.finishes == ["length"]
        assert p.finished and p.text == spell([1, 2, 3, 4])
        assert len(r.down.kept) == 1  # its generation ended: the connection is reused

    run(scenario)


def test_a_chat_text_resume_continues_the_assistant_turn() -> None:
    async def scenario() -> None:
        b = await engine(BackendKind.OPENAI, Stream([chat_chunk("lo!", finish="stop")]))
        messages = [{"role": "user", "content": "hi"}]
        async with rig(messages=messages) as r:
            p = r.first_stream([chat_chunk("Hel")])
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        assert result.failure is None and r.down.text == "lo!" and r.down.finishes == ["stop"]
        (asked,) = b.generations
        assert asked["messages"] == [*messages, {"role": "assistant", "content": "Hel"}]
        assert asked["continue_final_message"] is True
        assert asked["add_generation_prompt"] is False

    run(scenario)


def test_a_token_resume_checks_the_overlap_inline_and_sends_only_whats_new() -> None:
    async def scenario() -> None:
        ids = [[13], [14], [15], [16]]
        rest = Stream([chunk(t, with_ids=True, finish="length" if t == [16] else None)
                       for t in ids])  # fmt: skip
        b = await engine(BackendKind.VLLM, rest)
        settings = ResumeSettings(seam_mode=SeamMode.INLINE, seam_tokens=2)
        async with rig(settings, max_tokens=7, prompt="x") as r:
            p = r.first_stream(token_stream())
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        (asked,) = b.generations
        # Token-exact: the prompt's ids and the generated ones, less the 2 to regenerate.
        assert asked["prompt"] == [*PROMPT_IDS, 10, 11, 12] and asked["max_tokens"] == 4
        assert asked["return_token_ids"] is True
        assert result.seam is Seam.VERIFIED and result.path is ResumePath.TOKEN
        assert r.down.text == spell([15, 16])  # the regenerated overlap is not sent twice
        assert "token_ids" not in r.down.out.decode()  # ids the client did not ask for
        assert p.ids() == [*SENT, 15, 16]

    run(scenario)


def test_a_divergent_seam_is_redone_from_the_exact_prefix() -> None:
    async def scenario() -> None:
        other = Stream([chunk([13], with_ids=True), chunk([99], with_ids=True)])
        exact = Stream([chunk([15], with_ids=True), chunk([16], finish="length", with_ids=True)])
        b = await engine(BackendKind.VLLM, other, exact)
        settings = ResumeSettings(seam_mode=SeamMode.INLINE, seam_tokens=2)
        async with rig(settings, max_tokens=7, prompt="x") as r:
            p = r.first_stream(token_stream())
            result = await r.resumer.run(b.backend, p, time.perf_counter())
            assert result.verdict is not None
            assert await result.verdict is Seam.DIVERGENT
        await b.close()
        assert [g["prompt"] for g in b.generations] == [[*PROMPT_IDS, 10, 11, 12],
                                                        [*PROMPT_IDS, *SENT]]  # fmt: skip
        assert result.seam is Seam.DIVERGENT and result.failure is None
        # Nothing of the diverging attempt reached the client.
        assert r.down.text == spell([15, 16]) and p.ids() == [*SENT, 15, 16]

    run(scenario)


@pytest.mark.parametrize(
    ("check", "first_text", "verdict"),
    [
        ([13, 14], spell([15]), Seam.VERIFIED),
        ([13, 98], spell([15]), Seam.DIVERGENT),  # it would not regenerate the overlap
        ([13, 14], "w51 ", Seam.DIVERGENT),  # its first text is not its ids' text
    ],
)
def test_the_seam_is_judged_beside_the_stream_in_parallel_mode(
    check: list[int], first_text: str, verdict: Seam
) -> None:
    async def scenario() -> None:
        resumed = Stream([chunk([15], text=first_text, with_ids=True),
                          chunk([16], finish="length", with_ids=True)])  # fmt: skip
        overlap = Answer(200, {"choices": [{"text": spell(check), "token_ids": check}]})
        b = await engine(BackendKind.VLLM, resumed, overlap)
        settings = ResumeSettings(seam_mode=SeamMode.PARALLEL, seam_tokens=2)
        async with rig(settings, max_tokens=7, prompt="x") as r:
            p = r.first_stream(token_stream())
            result = await r.resumer.run(b.backend, p, time.perf_counter())
            # The client's stream went on at once from the exact prefix, unchecked...
            assert r.down.text == first_text + spell([16])
            assert result.verdict is not None
            # ...and the verdict comes when the check beside it lands.
            assert await result.verdict is verdict
        await b.close()
        resume, side = b.generations
        assert resume["prompt"] == [*PROMPT_IDS, *SENT] and resume["stream"] is True
        assert side["prompt"] == [*PROMPT_IDS, 10, 11, 12] and side["stream"] is False
        assert side["max_tokens"] == 2
        assert [15] in b.detokenized

    run(scenario)


def test_a_resume_that_cannot_be_faithful_is_refused_without_asking_an_engine() -> None:
    async def scenario() -> None:
        b = await engine()
        tools = [{"type": "function", "function": {"name": "f"}}]
        async with rig(messages=[{"role": "user", "content": "x"}], tools=tools) as r:
            p = r.first_stream([chat_chunk("Hel")])
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        assert result.failure == Failure.REFUSED and "tool calls" in result.detail
        assert b.requests == [] and r.down.out == b""

    run(scenario)


@pytest.mark.parametrize(
    ("status", "failure"),
    [(400, Failure.REJECTED), (413, Failure.REJECTED), (503, Failure.STATUS_5XX),
     (429, Failure.OVERLOADED)],
)  # fmt: skip
def test_an_engine_that_will_not_resume_is_told_apart_from_a_sick_one(
    status: int, failure: Failure
) -> None:
    async def scenario() -> None:
        b = await engine(BackendKind.OPENAI, Answer(status, {"error": {"type": "BadRequest"}}))
        async with rig(max_tokens=4) as r:
            p = r.first_stream([chunk([1])])
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        # A 4xx is this request refused (the relay skips the backend, control demotes
        # nobody); anything else is the backend's failure.
        assert result.failure == failure and f"resume answered {status}" in result.detail
        assert "(BadRequest)" in result.detail and r.down.out == b""

    run(scenario)


@pytest.mark.parametrize(
    ("events", "failure"),
    [
        ([chunk([3])], Failure.TRUNCATED),  # the body ends: no finish, no [DONE]
        ([chunk([3]), chunk([4], finish="abort")], Failure.FINISH_ABORT),
        ([chunk([3]), {"error": {"type": "InternalServerError"}}], Failure.ERROR_EVENT),
    ],
)
def test_a_resume_that_breaks_too_says_how(events: list[Any], failure: Failure) -> None:
    async def scenario() -> None:
        b = await engine(BackendKind.OPENAI, Stream(events, done=False))
        async with rig(max_tokens=9) as r:
            p = r.first_stream([chunk([1])])
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        assert result.failure == failure
        # What was relayed stays relayed (the next resume goes on after it); the broken
        # connection is dropped, never reused.
        assert r.down.text == spell([3]) and p.text == spell([1, 3]) and not p.finished
        assert r.down.kept == []

    run(scenario)


def test_every_token_sent_already_ends_the_choice_without_an_engine() -> None:
    async def scenario() -> None:
        b = await engine()
        async with rig(max_tokens=2) as r:
            p = r.first_stream([chunk([1]), chunk([2])])
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        assert result.failure is None and "max_tokens reached" in result.detail
        assert b.requests == [] and r.down.finishes == ["length"] and p.finish_reason == "length"

    run(scenario)


def test_a_resume_on_a_migrating_backend_hands_over_at_a_chunk_boundary() -> None:
    async def scenario() -> None:
        c = await FakeEngine("c").start()
        b = await engine(BackendKind.OPENAI, Stream([chunk([3]), chunk([4]), chunk([5])]))
        async with rig(down=Down(move_to=c.backend), max_tokens=9) as r:
            p = r.first_stream([chunk([1])])
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        await c.close()
        assert result.failure == Failure.MIGRATE and result.handover == c.backend
        assert r.down.text == spell([3])  # moved after the first chunk it relayed
        assert r.down.kept == []

    run(scenario)


def test_a_seam_with_matching_ids_is_divergent_when_the_clients_fields_are_not_by_ids() -> None:
    """The engine labelled part of the answer as reasoning before it died: the resume's
    overlap regenerates the same ids and text, yet the client's reasoning and content are
    not an uninterrupted stream's, so the seam is not reported verified."""
    start, end = 300, 301

    def think(delta: dict[str, Any], ids: list[int], first: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                               "created": 7, "model": "m",
                               "choices": [{"index": 0, "delta": delta, "token_ids": ids}]}
        if first:
            out["prompt_token_ids"] = [1, 2, start]
        return out  # fmt: skip

    async def scenario(relabel: bool) -> Seam | None:
        rest = Stream([chunk([13], with_ids=True), chunk([14], with_ids=True),
                       chunk([15], with_ids=True, finish="length")])  # fmt: skip
        b = await engine(BackendKind.VLLM, rest)
        settings = ResumeSettings(seam_mode=SeamMode.INLINE, seam_tokens=2)
        messages = [{"role": "user", "content": "hi"}]
        async with rig(settings, messages=messages, max_tokens=6) as r:
            r.stitcher.follow_reasoning("deepseek_r1", Markers(start, end, "<think>", "</think>"))
            answer = "reasoning" if relabel else "content"
            p = r.first_stream([
                think({"role": "assistant", "content": ""}, [], first=True),
                think({"reasoning": spell([10])}, [10]), think({}, [end]),
                think({answer: spell([12])}, [12]), think({"content": spell([13])}, [13]),
                think({"content": spell([14])}, [14]),
            ])  # fmt: skip
            result = await r.resumer.run(b.backend, p, time.perf_counter())
        await b.close()
        assert result.failure is None and r.down.text == spell([15])
        return result.seam

    assert run(lambda: scenario(relabel=False)) is Seam.VERIFIED
    assert run(lambda: scenario(relabel=True)) is Seam.DIVERGENT
