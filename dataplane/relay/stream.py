"""One client stream, end to end: relay the first backend's events and, when that backend
fails mid-stream, resume every unfinished choice on another backend
(dataplane/relay/resume/choose.py picks where, dataplane/relay/resume/plan.py plans it,
dataplane/relay/resume/attempt.py runs one attempt, dataplane/relay/stitch.py shapes what the client
sees, dataplane/relay/resume/reports.py tells control). The client gets one unbroken stream or an
explicit error event; never a silently truncated one."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import orjson

from baton.model import Backend, FailoverOutcome, FailoverReport, Failure
from dataplane.exceptions import ErrorKind, OpenAIError, StreamFailed
from dataplane.link.needs import FailoverAdvice, FailoverAudit
from dataplane.relay.context import StreamContext
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume.attempt import TOKEN_KINDS, Resumer, Started, ends_here
from dataplane.relay.resume.choose import Chooser
from dataplane.relay.resume.migration import Migration
from dataplane.relay.resume.plan import refusal
from dataplane.relay.resume.reports import Reporter
from dataplane.relay.resume.resumed import ChoiceResume
from dataplane.relay.stitch import Stitcher
from dataplane.request import ClientRequest
from dataplane.settings import ResumeSettings, RetryBudget
from dataplane.sse import ClientStream
from dataplane.upstream.chunks import error_type
from dataplane.upstream.engine import read_events

log = logging.getLogger("baton.shim.stream")

__all__ = ["ResumeSettings", "StreamRelay", "with_token_ids"]


class RelayControl(FailoverAdvice, FailoverAudit, Protocol):
    """What a stream's relay asks of control: where to go, and the failover's report."""


@dataclass(slots=True)
class _Failing:
    """The failover loop's state: the backend that failed last and why, and what was tried."""

    backend: Backend
    failure: Failure  # what control hears
    cause: str  # why this round: a refusal (REJECTED) spends no health
    detected: float  # perf_counter when the client's stream last stopped
    decided: Backend | None = None  # where control already said to go
    exclude: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)  # backends that answered a resume 4xx
    attempt: int = 0
    counted: int = 0  # attempts that spend the resume budget

    @property
    def note(self) -> str:
        return f"; refused by {', '.join(self.refusals)}" if self.refusals else ""


@dataclass(frozen=True, slots=True)
class Relayed:
    """What a relayed stream was, once it ended: all the proxy reports of it (the outcome
    control hears, the span's attributes), read here so nothing outside the relay reads the
    stitcher."""

    complete: bool  # the client got a whole answer (else an error event)
    served_by: Backend  # the backend that finished it
    first_byte: float | None  # monotonic time of the first byte the client got
    reply: str | None  # a complete answer's first choice, the next turn's prefix
    first_choice: ChoiceProgress | None  # its token ids, for the KV blocks it implies
    finishes: tuple[str | None, ...]
    response_id: str | None
    model: str | None
    prompt_tokens: int
    completion_tokens: int


class StreamRelay:
    def __init__(
        self,
        ctx: StreamContext,
        *,
        session: aiohttp.ClientSession,
        control: RelayControl,
        resp: ClientStream,
    ) -> None:
        """`session`: the pool resumes are opened from; `resp`: the client's stream."""
        self._markers = ctx.markers
        self._settings = ctx.settings
        self._resp = resp
        self._rid = ctx.request_id
        self._client = ctx.client
        self._budget = RetryBudget(ctx.settings.max_resumes, ctx.settings.max_resume_seconds)
        self.stitcher = Stitcher(ctx.client, strip_ids=not ctx.client.body.get("return_token_ids"))
        # Upstream responses whose generation is over: finished_upstreams() hands them over.
        self._trailers: list[aiohttp.ClientResponse] = []
        self._resumer = Resumer(
            session=session,
            timeouts=ctx.timeouts,
            settings=ctx.settings,
            client=ctx.client,
            stitcher=self.stitcher,
            downstream=self,
        )
        self._chooser = Chooser(ctx, control=control, resumer=self._resumer)
        self._migration = Migration(ctx, control=control, chooser=self._chooser,
                                    stitcher=self.stitcher)  # fmt: skip
        self._reporter = Reporter(control, ctx.metrics, ctx.tracing, ctx.background)
        self.first_byte: float | None = None
        self.served_by: Backend | None = None

    async def run(self, backend: Backend, upstream: aiohttp.ClientResponse, first: bytes) -> bool:
        """True when the client got a complete answer, False when it got an error event."""
        self.served_by = backend
        parser = backend.reasoning_parser
        if parser and self.stitcher.chat:
            markers = await self._markers.get(backend) if self._markers is not None else None
            self.stitcher.follow_reasoning(parser, markers)
        try:
            target = await self._pump(backend, upstream, first)
        except StreamFailed as failed:
            upstream.close()
            if self.stitcher.unfinished():
                return await self._failover(backend, failed)
            # Every choice had finished: only the tail (usage, [DONE]) was lost.
            self.stitcher.resumed = self.stitcher.usage is None
        else:
            if target is not None:
                # Planned: stopped at a chunk boundary; closing stops the old generation.
                upstream.close()
                moved = StreamFailed(Failure.MIGRATE, f"{backend.id} drained with migration")
                return await self._failover(backend, moved, target)
            self._trailers.append(upstream)  # it sent [DONE]
        await self._resp.write(self.stitcher.ending())
        return True

    def relayed(self, complete: bool, backend: Backend) -> Relayed:
        """`backend`: the one the stream started on."""
        st = self.stitcher
        first = st.choices.get(0)
        inputs, outputs = st.token_counts()
        return Relayed(
            complete=complete,
            served_by=self.served_by or backend,
            first_byte=self.first_byte,
            reply=first.reply if complete and first is not None else None,
            first_choice=first,
            finishes=tuple(c.finish_reason for c in st.choices.values()),
            response_id=st.ident.id,
            model=st.ident.model,
            prompt_tokens=inputs,
            completion_tokens=outputs,
        )

    def finished_upstreams(self) -> list[aiohttp.ClientResponse]:
        """Hands over the upstream responses whose generation is over, for the caller to
        settle (engine.settle) once the client's answer is complete."""
        out = list(self._trailers)
        self._trailers.clear()
        return out

    def close(self) -> None:
        """Drop every upstream still held (the client left, or the answer failed)."""
        for t in self._trailers:
            t.close()
        self._trailers.clear()

    def keep(self, upstream: aiohttp.ClientResponse) -> None:
        self._trailers.append(upstream)

    # -- Downstream, for the resumer too ---------------------------------------------------

    def due(self, backend_id: str) -> bool:
        return self._migration.due(backend_id)

    async def target(self, backend: Backend) -> Backend | None:
        return await self._migration.target(backend)

    async def write(self, data: bytes) -> None:
        if self.first_byte is None:
            self.first_byte = time.monotonic()
        await self._resp.write(data)
        self._chooser.wrote()

    async def _pump(
        self, backend: Backend, upstream: aiohttp.ClientResponse, first: bytes
    ) -> Backend | None:
        """Relays the first stream to its end. Returns where to move it when `backend` is
        drained with migration (decided between two reads: a chunk boundary)."""
        original = self.stitcher.original
        async for events in read_events(upstream.content, first, self._settings, False):
            out: list[bytes] = []
            for event in events:
                if event.is_done:
                    if out:
                        await self.write(b"".join(out))
                    if self.stitcher.unfinished():
                        raise StreamFailed(Failure.TRUNCATED, "[DONE] before every choice finished")
                    return None
                piece, failure = original(event.data, event.raw)
                if piece:
                    out.append(piece)
                if failure:
                    if out:
                        await self.write(b"".join(out))
                    why = error_type(event.data) if failure == Failure.ERROR_EVENT else ""
                    raise StreamFailed(failure, why)
            # What one read delivered goes out in one write.
            if out:
                await self.write(b"".join(out))
            if self.due(backend.id):  # a chunk boundary: a migration can start here
                target = await self.target(backend)
                if target is not None:
                    return target
        return None

    # -- failover ------------------------------------------------------------------------

    async def _failover(
        self, failed_backend: Backend, failed: StreamFailed, decided: Backend | None = None
    ) -> bool:
        """Resume every unfinished choice elsewhere until all have finished or the budget is
        spent. `decided`: where control already said to go (a migration asks first)."""
        self.stitcher.resumed = True
        # perf_counter, not loop.time(): uvloop's loop clock ticks in whole milliseconds,
        # too coarse for a gap of a few ms.
        now = time.perf_counter()
        st = _Failing(failed_backend, failed.failure, failed.failure, now, decided)
        self._reporter.detected_ns = time.time_ns()
        while True:
            pending = await self._end_exhausted(self.stitcher.unfinished())
            if not pending:
                await self._resp.write(self.stitcher.ending())
                return True
            st.attempt += 1
            if st.cause != Failure.MIGRATE:  # a planned move spends none of the resume budget
                st.counted += 1
            # A refusal needs no backend: checked before asking for one.
            why = next(filter(None, (refusal(self._client, p) for p in pending)), None)
            if why is not None:
                await self._chooser.ask(st.backend, st.failure, st.exclude, ())
                return await self._give_up(st, FailoverOutcome.REFUSED, why)
            if not self._budget.allows(max(st.counted - 1, 0), time.perf_counter() - st.detected):
                return await self._give_up(
                    st, FailoverOutcome.EXHAUSTED, "resume budget exhausted" + st.note
                )
            backend, st.decided = st.decided, None
            early: dict[int, Started] = {}
            if backend is None:
                backend, early = await self._chooser.choose(
                    st.backend, st.failure, st.exclude, pending
                )
            if backend is None:
                reason = "no other backend available" + st.note
                return await self._give_up(st, FailoverOutcome.EXHAUSTED, reason)
            results = await self._resume_all(st, backend, early, pending)
            self._next_round(st, backend, results)

    async def _resume_all(
        self,
        st: _Failing,
        backend: Backend,
        early: dict[int, Started],
        pending: list[ChoiceProgress],
    ) -> list[ChoiceResume]:
        """One round: every pending choice resumed on `backend`, each reported."""
        log.info("request %s: %s failed (%s); resuming on %s",
                 self._rid, st.backend.id, st.failure, backend.id)  # fmt: skip
        sent = {p.index: p.generated for p in pending}
        runs = [self._resumer.run(backend, p, st.detected, early.get(p.index)) for p in pending]
        try:
            # One choice, the usual case, needs no task: one event-loop turn less per gap.
            results = [await runs[0]] if len(runs) == 1 else list(await asyncio.gather(*runs))
        except BaseException:
            for started in early.values():  # a run cancelled before it began owns nothing
                started.upstream.close()
            raise
        self._chooser.speak()  # in case the resume ended before its second write
        for p, r in zip(pending, results, strict=True):
            outcome = FailoverOutcome.RESUMED if r.failure is None else FailoverOutcome.FAILED
            self._reporter.report(
                r,
                FailoverReport(
                    request_id=self._rid, from_backend=st.backend.id, to_backend=backend.id,
                    failure=st.failure, choice=p.index, tokens_sent=sent[p.index],
                    path=r.path, seam=r.seam, gap_ms=r.gap_ms, attempt=st.attempt,
                    outcome=outcome, detail=r.detail,
                ),
            )  # fmt: skip
        self.served_by = backend
        return results

    def _next_round(self, st: _Failing, backend: Backend, results: list[ChoiceResume]) -> None:
        """After a round with broken resumes: what failed, and where not to go again."""
        broken = [r for r in results if r.failure is not None]
        if not broken:
            return
        if any(r.gap_ms for r in results):
            # The client got resumed bytes since: a new failure starts a new gap (and
            # a new resume clock) from now.
            st.detected = time.perf_counter()
            self._reporter.detected_ns = time.time_ns()
        hard = [r for r in broken if r.failure != Failure.REJECTED]
        if not hard:
            # The backend refused our request, which says nothing of its health: skip
            # it, and keep reporting the original failure so control demotes nobody new.
            st.exclude.append(backend.id)
            st.refusals.append(f"{backend.id}: {broken[0].detail}")
            st.cause = Failure.REJECTED
            return
        st.exclude.append(st.backend.id)
        worst = next((r for r in hard if r.failure != Failure.MIGRATE), hard[0])
        st.backend, st.failure = backend, worst.failure or Failure.UNKNOWN
        st.cause = st.failure
        if st.failure == Failure.MIGRATE:
            st.decided = worst.handover

    async def _end_exhausted(self, pending: list[ChoiceProgress]) -> list[ChoiceProgress]:
        """Ends every choice that needs no backend to end (ends_here); returns the rest."""
        left = []
        for p in pending:
            if ends_here(self._client, p):
                log.info("request %s: choice %d had all its tokens; finished", self._rid, p.index)
                await self._resumer.end_at_limit(p)
            else:
                left.append(p)
        return left

    async def _give_up(self, st: _Failing, outcome: FailoverOutcome, why: str) -> bool:
        for p in self.stitcher.unfinished():
            self._reporter.send(
                FailoverReport(
                    request_id=self._rid, from_backend=st.backend.id, to_backend="",
                    failure=st.failure, choice=p.index, tokens_sent=p.generated, path=None,
                    seam=None, gap_ms=0.0, attempt=st.attempt, outcome=outcome, detail=why,
                )
            )  # fmt: skip
        kind = ErrorKind.BACKEND_FAILED
        message = f"backend {st.backend.id} failed mid-stream ({st.failure}) and the stream " + (
            f"cannot be resumed: {why}"
            if outcome is FailoverOutcome.REFUSED
            else f"was not resumed: {why}"
        )
        await self._resp.write(OpenAIError(kind, message).sse())
        return False


def with_token_ids(client: ClientRequest, backend: Backend, raw: bytes) -> bytes:
    """The first attempt's body: ask token-id engines for ids, so a failure can resume
    token-exact. Other backends get the client's bytes untouched."""
    if not client.stream or backend.kind not in TOKEN_KINDS or client.body.get("return_token_ids"):
        return raw
    return orjson.dumps({**client.body, "return_token_ids": True})
