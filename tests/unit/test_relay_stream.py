"""One client stream end to end (dataplane/relay/stream.py, StreamRelay): relayed as it is
when the backend finishes, resumed elsewhere when it fails mid-stream (as often as the
budget allows), or ended with an explicit error event when it cannot be: never cut short in
silence. Engines are in-process fakes over HTTP and control a recording fake
(tests/unit/relay_fakes.py); what the client received is read back byte for byte."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from baton.model import (
    Backend,
    BackendKind,
    FailoverOutcome,
    Failure,
    ResumePath,
    Seam,
    SeamMode,
)
from dataplane.relay.resume.markers import MarkerCache
from dataplane.relay.resume.reasoning import Markers
from dataplane.relay.stream import StreamRelay
from dataplane.request import Endpoint
from dataplane.settings import ResumeSettings
from tests.factories import client_request
from tests.unit.relay_fakes import (
    Answer,
    Client,
    FakeControl,
    FakeEngine,
    Stream,
    chunk,
    engines,
    open_stream,
    run,
    settle,
    spell,
    stream_context,
)

TEXT_RESUMES = ResumeSettings(seam_tokens=0)


@dataclass
class Outcome:
    complete: bool
    client: Client
    control: FakeControl
    served_by: Backend | None


@asynccontextmanager
async def fleet(*names: str, kind: BackendKind = BackendKind.OPENAI) -> AsyncIterator[Any]:
    es = await engines(*names, kind=kind)
    try:
        yield es
    finally:
        for e in es:
            await e.close()


async def relay(
    first: FakeEngine,
    fallbacks: Sequence[FakeEngine],
    control: FakeControl | None = None,
    settings: ResumeSettings = TEXT_RESUMES,
    endpoint: Endpoint = Endpoint.COMPLETIONS,
    markers: MarkerCache | None = None,
    **body: object,
) -> Outcome:
    """The client's streaming request (a completion unless `endpoint` says otherwise), its
    first attempt on `first` (whose reply is scripted), relayed to its end; every task it
    left behind finished. `markers`: the think tags the shim knows."""
    control = control or FakeControl()
    client = Client()
    request = client_request(endpoint, **{"max_tokens": 4, **body})
    ctx = stream_context(request, [f.backend for f in fallbacks], settings)
    if markers is not None:
        ctx = dataclasses.replace(ctx, markers=markers)
    async with aiohttp.ClientSession() as session:
        r = StreamRelay(ctx, session=session, control=control, resp=client)
        upstream = await open_stream(session, first, dict(request.body))
        try:
            complete = await r.run(first.backend, upstream, b"")
            await settle(ctx.background)
            for u in r.finished_upstreams():
                u.close()
        finally:
            r.close()
            upstream.close()
    return Outcome(complete, client, control, r.served_by)


def ended_once(client: Client) -> bool:
    """[DONE] is the stream's last event, and its only one."""
    return client.events.count("[DONE]") == 1 and client.events[-1] == "[DONE]"


def test_a_backend_that_finishes_is_relayed_as_it_is() -> None:
    async def scenario() -> None:
        async with fleet("a", "b") as (a, b):
            a.script(Stream([chunk([1]), chunk([2]), chunk([3], finish="stop")]))
            out = await relay(a, [b])
        assert out.complete and out.client.text == spell([1, 2, 3])
        assert out.client.finishes == ["stop"] and ended_once(out.client)
        assert out.client.errors == [] and out.served_by == a.backend
        # Nobody else was bothered: no resume, nothing for control.
        assert b.requests == [] and out.control.calls == [] and out.control.reports == []

    run(scenario)


def test_a_stream_whose_every_choice_finished_needs_no_resume_for_its_lost_tail() -> None:
    async def scenario() -> None:
        async with fleet("a", "b") as (a, b):
            a.script(Stream([chunk([1]), chunk([2], finish="stop")], done=False))
            out = await relay(a, [b])
        assert out.complete and out.client.text == spell([1, 2]) and ended_once(out.client)
        assert b.requests == [] and out.control.calls == []

    run(scenario)


@pytest.mark.parametrize(
    ("ending", "failure"),
    [
        (Stream([chunk([1]), chunk([2])], done=False), Failure.TRUNCATED),  # the body ends
        (Stream([chunk([1]), chunk([2])]), Failure.TRUNCATED),  # [DONE] before the finish
        (Stream([chunk([1]), chunk([2]), chunk([], finish="abort")]), Failure.FINISH_ABORT),
        (Stream([chunk([1]), chunk([2]), {"error": {"type": "oom"}}]), Failure.ERROR_EVENT),
    ],
)
def test_a_stream_broken_mid_way_is_resumed_on_the_routes_next_fallback(
    ending: Stream, failure: Failure
) -> None:
    async def scenario() -> None:
        async with fleet("a", "b", "c") as (a, b, c):
            a.script(ending)
            b.script(Stream([chunk([3]), chunk([4], finish="length")]))
            out = await relay(a, [b, c], stream_options={"include_usage": True})
            await out.control.until(lambda: bool(out.control.calls))
        # One unbroken answer: what a sent, then the rest from b, each token once.
        assert out.complete and out.client.text == spell([1, 2, 3, 4])
        assert out.client.finishes == ["length"] and ended_once(out.client)
        assert out.client.errors == [] and out.served_by == b.backend and c.requests == []
        usage = [e["usage"] for e in out.client.events if isinstance(e, dict) and e.get("usage")]
        assert usage[-1]["completion_tokens"] == 4  # counted over both backends
        (report,) = out.control.reports
        assert (report.from_backend, report.to_backend, report.failure) == ("a", "b", failure)
        assert report.outcome is FailoverOutcome.RESUMED and report.tokens_sent == 2
        assert report.path is ResumePath.TEXT and report.attempt == 1
        # Control hears that a failed (it demotes it), with b as where it went.
        (call,) = out.control.calls
        assert (call.failed, call.failure, call.preferred) == ("a", failure, ["b", "c"])

    run(scenario)


def test_a_stream_that_cannot_be_resumed_faithfully_ends_in_an_error_event() -> None:
    async def scenario() -> None:
        async with fleet("a", "b") as (a, b):
            a.script(Stream([chunk([1]), chunk([2])], done=False))
            out = await relay(a, [b], frequency_penalty=0.5)
        assert not out.complete and out.client.text == spell([1, 2])
        (error,) = out.client.errors
        assert error["code"] == "backend_failed" and "cannot be resumed" in error["message"]
        assert "frequency_penalty" in error["message"] and ended_once(out.client)
        assert b.requests == []  # no engine asked to do what it could not do faithfully
        (report,) = out.control.reports
        assert report.outcome is FailoverOutcome.REFUSED and report.to_backend == ""
        assert [c.failed for c in out.control.calls] == ["a"]  # a is still demoted

    run(scenario)


@pytest.mark.parametrize("then", ["c", None], ids=["another backend", "none left"])
def test_a_backend_refusing_the_resume_is_skipped_without_blame(then: str | None) -> None:
    async def scenario() -> None:
        async with fleet("a", "b", "c") as (a, b, c):
            a.script(Stream([chunk([1]), chunk([2])], done=False))
            b.script(Answer(400, {"error": {"type": "BadRequestError"}}))
            c.script(Stream([chunk([3]), chunk([4], finish="length")]))
            control = FakeControl(answers=[b.backend, c.backend if then else None])
            out = await relay(a, [], control)
        assert [r.outcome for r in out.control.reports][0] is FailoverOutcome.FAILED
        first = out.control.reports[0]
        assert (first.to_backend, first.failure) == ("b", "truncated")
        # Every call and report blames a, whose stream broke; never b, which only refused.
        assert {call.failed for call in out.control.calls} == {"a"}
        assert {r.from_backend for r in out.control.reports} == {"a"}
        assert out.control.calls[1].exclude == ["b"]
        if then:
            assert out.complete and out.client.text == spell([1, 2, 3, 4])
            assert out.control.reports[-1].outcome is FailoverOutcome.RESUMED
        else:
            assert not out.complete and out.client.text == spell([1, 2])
            (error,) = out.client.errors
            assert "no other backend available; refused by b" in error["message"]
            assert out.control.reports[-1].outcome is FailoverOutcome.EXHAUSTED

    run(scenario)


@pytest.mark.parametrize("max_resumes", [1, 3])
def test_a_resume_that_fails_too_is_resumed_again_while_the_budget_allows(
    max_resumes: int,
) -> None:
    async def scenario() -> None:
        async with fleet("a", "b", "c") as (a, b, c):
            a.script(Stream([chunk([1])], done=False))
            b.script(Stream([chunk([2])], done=False))
            c.script(Stream([chunk([3]), chunk([4], finish="length")]))
            settings = ResumeSettings(seam_tokens=0, max_resumes=max_resumes)
            out = await relay(a, [b, c], settings=settings)
        reports = out.control.reports
        assert (reports[0].from_backend, reports[0].to_backend) == ("a", "b")
        assert reports[0].outcome is FailoverOutcome.FAILED
        if max_resumes == 1:
            assert not out.complete and out.client.text == spell([1, 2])
            (error,) = out.client.errors
            assert "was not resumed: resume budget exhausted" in error["message"]
            assert reports[-1].outcome is FailoverOutcome.EXHAUSTED and c.requests == []
        else:
            assert out.complete and out.client.text == spell([1, 2, 3, 4])
            # The second failure is b's: c resumes after everything the client has.
            assert (reports[-1].from_backend, reports[-1].to_backend) == ("b", "c")
            assert reports[-1].outcome is FailoverOutcome.RESUMED
            assert c.generations[0]["prompt"] == "x" + spell([1, 2])
        assert ended_once(out.client)

    run(scenario)


def test_a_token_resume_is_reported_once_its_seam_is_checked() -> None:
    async def scenario() -> None:
        async with fleet("a", "b", kind=BackendKind.VLLM) as (a, b):
            sent = [chunk([t], with_ids=True, prompt_ids=[1, 2] if t == 10 else None)
                    for t in range(10, 15)]  # fmt: skip
            a.script(Stream(sent, done=False))
            overlap = [11, 12, 13, 14]  # what b regenerates when the seam is checked beside
            b.script(
                Stream([chunk([15], with_ids=True), chunk([16], finish="length", with_ids=True)]),
                Answer(200, {"choices": [{"text": spell(overlap), "token_ids": overlap}]}),
            )
            out = await relay(a, [b], settings=ResumeSettings(seam_tokens=4), max_tokens=7)
        assert out.complete and out.client.text == spell(range(10, 17))
        assert "token_ids" not in out.client.out.decode()  # asked for by Baton, not the client
        assert b.generations[0]["prompt"] == [1, 2, *range(10, 15)]
        (report,) = out.control.reports
        assert report.path is ResumePath.TOKEN and report.seam is Seam.VERIFIED

    run(scenario)


def test_a_stream_on_a_migrating_backend_moves_at_a_chunk_boundary() -> None:
    async def scenario() -> None:
        async with fleet("a", "b") as (a, b):
            # a goes on generating; the move happens after its first chunk, when it is asked.
            a.script(Stream([chunk([1])], hang=True))
            b.script(Stream([chunk([2]), chunk([3]), chunk([4], finish="length")]))
            control = FakeControl(answers=[b.backend], migrating=[a.backend])
            out = await relay(a, [b], control)
        assert out.complete and out.client.errors == [] and ended_once(out.client)
        assert out.client.text == spell([1, 2, 3, 4]) and out.served_by == b.backend
        assert b.generations[0]["prompt"] == "x" + spell([1])
        (call,) = out.control.calls
        assert (call.failed, call.failure) == ("a", Failure.MIGRATE)
        (report,) = out.control.reports
        assert report.failure == Failure.MIGRATE and report.outcome is FailoverOutcome.RESUMED

    run(scenario)


class KnownTags(MarkerCache):
    """A shim that has learned the model's think tags (special: streams skip their text)."""

    def __init__(self, markers: Markers) -> None:
        self._markers_known = markers

    async def get(self, backend: Backend) -> Markers | None:
        return self._markers_known


def test_a_mis_split_tag_chunk_the_dying_engine_cannot_decode_fails_over_before_it() -> None:
    """vLLM sent the special </think> merged with other tokens, split at find() == -1, and
    died: its /detokenize cannot say where the tag's chunk splits. The chunk never reaches
    the client; the stream fails over before it and the resume splits those tokens by ids."""
    start, end = 300, 301

    def think(delta: dict[str, Any], ids: list[int], **top: Any) -> dict[str, Any]:
        return {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                "choices": [{"index": 0, "delta": delta, "token_ids": ids}], **top}  # fmt: skip

    async def scenario() -> None:
        async with fleet("a", "b", kind=BackendKind.VLLM) as (a, b):
            mangled = spell([11, 12])  # vLLM: reasoning text[:-1], content text[7:]
            a.script(Stream([
                think({"role": "assistant", "content": ""}, [], prompt_token_ids=[1, 2, start]),
                think({"reasoning": spell([10])}, [10]),
                think({"reasoning": mangled[:-1], "content": mangled[7:]}, [11, end, 12]),
            ], done=False))  # fmt: skip
            a.detokenize_status = 503
            b.script(Stream([chunk([11], with_ids=True), chunk([end], with_ids=True, text=""),
                             chunk([12], with_ids=True),
                             chunk([13], with_ids=True, finish="length")]))  # fmt: skip
            a.backend = dataclasses.replace(a.backend, reasoning_parser="deepseek_r1")
            tags = KnownTags(Markers(start, end, "<think>", "</think>", special=True))
            out = await relay(a, [b], settings=ResumeSettings(seam_mode=SeamMode.INLINE,
                              seam_tokens=0), endpoint=Endpoint.CHAT, markers=tags,
                              max_tokens=5)  # fmt: skip
            await out.control.until(lambda: bool(out.control.reports))
        deltas = [ch.get("delta") or {} for e in out.client.events if isinstance(e, dict)
                  for ch in e.get("choices") or ()]  # fmt: skip
        thought = "".join(d.get("reasoning") or "" for d in deltas)
        assert out.complete and out.client.errors == []
        assert (thought, out.client.text) == (spell([10, 11]), spell([12, 13]))
        (report,) = out.control.reports
        assert report.tokens_sent == 1 and report.outcome is FailoverOutcome.RESUMED
        (asked,) = b.generations
        assert asked["prompt"] == [1, 2, start, 10]  # from before the chunk nobody saw

    run(scenario)
