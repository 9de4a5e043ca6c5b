"""One client stream, end to end: relay the first backend's events and, when that backend
fails mid-stream, resume every unfinished choice on another backend (resume.py plans it,
resumer.py runs one attempt, stitch.py shapes what the client sees). The client gets one
unbroken stream or an explicit error event; never a silently truncated one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import aiohttp
import orjson
from aiohttp import web

from baton.model import Backend, FailoverOutcome, FailoverReport, RequestShape, Seam
from baton.tracing import OFF, Tracing
from dataplane.engine import AttemptFailed, StreamFailed, Timeouts, read_events
from dataplane.errors import ErrorKind, OpenAIError
from dataplane.failover import Failure, RetryBudget
from dataplane.metrics import ShimMetrics
from dataplane.oracle import ControlUnavailable, Oracle
from dataplane.resume.attempt import (
    TOKEN_KINDS,
    ChoiceResume,
    Resumer,
    Started,
    tokens_left,
)
from dataplane.resume.markers import MarkerCache
from dataplane.resume.plan import Refused, refusal
from dataplane.resume.progress import ChoiceProgress
from dataplane.resume.stitch import Stitcher
from dataplane.settings import ResumeSettings
from dataplane.validate import ClientRequest

log = logging.getLogger("baton.shim.stream")
# Longest a Failover call waits for the resumed stream to flow (see StreamRelay._tell_later).
CONTROL_AFTER_S = 0.1
# A stream on a migrating backend with nowhere to go keeps streaming there; control is asked
# again at most this often (it may have a backend by then).
MIGRATION_RETRY_S = 1.0

__all__ = ["ResumeSettings", "StreamRelay", "with_token_ids"]


class StreamRelay:
    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        oracle: Oracle,
        timeouts: Timeouts,
        settings: ResumeSettings,
        resp: web.StreamResponse,
        request_id: str,
        client: ClientRequest,
        shape: RequestShape,
        fallbacks: Sequence[Backend],
        background: set[asyncio.Task[None]],
        metrics: ShimMetrics,
        markers: MarkerCache | None = None,
        tracing: Tracing = OFF,
    ) -> None:
        """`fallbacks`: the route decision's backends in order, control's preference for
        where to resume. `background`: the proxy's set of tasks that may outlive this
        request (a seam check still running when the stream ends)."""
        self._background = background
        self._metrics = metrics
        self._markers = markers
        self._tracing = tracing
        self._detected_ns = 0  # wall clock of the current failure, for the failover span
        self._oracle = oracle
        self._settings = settings
        self._resp = resp
        self._rid = request_id
        self._client = client
        self._shape = shape
        self._fallbacks = tuple(fallbacks)
        self._budget = RetryBudget(settings.max_resumes, settings.max_resume_seconds)
        self.stitcher = Stitcher(client, strip_ids=not client.body.get("return_token_ids"))
        # Upstream responses whose generation is over: finished_upstreams() hands them over.
        self._trailers: list[aiohttp.ClientResponse] = []
        self._resumer = Resumer(
            session=session,
            timeouts=timeouts,
            settings=settings,
            client=client,
            stitcher=self.stitcher,
            write=self._write,
            handover=self,
            trailers=self._trailers,
        )
        self.first_byte: float | None = None
        self.served_by: Backend | None = None
        # A Failover call held back until the resumed stream flows (see _tell_later), and the
        # resumed writes since it was.
        self._tell: Callable[[], None] | None = None
        self._told_after = 0
        self._ask_after = 0.0  # when control may next be asked where to migrate

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

    def finished_upstreams(self) -> list[aiohttp.ClientResponse]:
        """Hands over the upstream responses whose generation is over, for the caller to
        settle (upstream_sse.settle) once the client's answer is complete."""
        out = list(self._trailers)
        self._trailers.clear()
        return out

    def close(self) -> None:
        """Drop every upstream still held (the client left, or the answer failed)."""
        for t in self._trailers:
            t.close()
        self._trailers.clear()

    # -- migration (Handover, for the resumer too) -----------------------------------------

    def due(self, backend_id: str) -> bool:
        """Is `backend_id` drained with migration, and may control be asked where to go
        (at most every MIGRATION_RETRY_S)? A set lookup at every chunk; the clock only
        while the backend migrates."""
        return backend_id in self._oracle.fleet.migrating and time.monotonic() >= self._ask_after

    async def target(self, backend: Backend) -> Backend | None:
        """Control's choice for a stream leaving `backend`. Asked before the stream stops,
        so a migration with nowhere to go leaves the stream where it is: a drain with
        --migrate never turns a healthy stream into an error. (Control releases the
        request's load on `backend` either way; it is counted again when it ends.)"""
        self._ask_after = time.monotonic() + MIGRATION_RETRY_S
        unfinished = self.stitcher.unfinished()
        if not unfinished:
            return None  # a stream whose choices all finished is left to send its last events
        why = next(filter(None, (refusal(self._client, p) for p in unfinished)), None)
        if why is not None:
            # It would end in an error event; finishing here is what a plain drain does.
            log.info("request %s: not migrating off %s: %s", self._rid, backend.id, why)
            self._ask_after = float("inf")
            return None
        gone = {backend.id, *self._oracle.fleet.migrating}
        preferred = [b.id for b in self._fallbacks if b.id not in gone]
        target = await self._oracle_failover(backend, Failure.MIGRATE, [], preferred)
        if target is None:
            log.warning(
                "request %s: %s is migrating but no backend can take its stream; staying",
                self._rid,
                backend.id,
            )
        return target

    async def _write(self, data: bytes) -> None:
        if self.first_byte is None:
            self.first_byte = time.monotonic()
        await self._resp.write(data)
        if self._tell is not None:
            self._told_after += 1
            if self._told_after >= 2:
                self._speak()

    def _speak(self) -> None:
        """Make the Failover call held back for the resume (see _tell_later), if one is."""
        tell, self._tell = self._tell, None
        if tell is not None:
            tell()

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
                        await self._write(b"".join(out))
                    if self.stitcher.unfinished():
                        raise StreamFailed(Failure.TRUNCATED, "[DONE] before every choice finished")
                    return None
                piece, failure = original(event.data, event.raw)
                if piece:
                    out.append(piece)
                if failure:
                    if out:
                        await self._write(b"".join(out))
                    raise StreamFailed(failure)
            # What one read delivered goes out in one write.
            if out:
                await self._write(b"".join(out))
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
        stitcher = self.stitcher
        stitcher.resumed = True
        # perf_counter, not loop.time(): uvloop's loop clock ticks in whole milliseconds,
        # too coarse for a gap of a few ms.
        detected = time.perf_counter()
        self._detected_ns = time.time_ns()
        failure = cause = failed.failure  # cause: why this round; failure: what control hears
        exclude: list[str] = []
        refusals: list[str] = []  # backends that answered a resume with a 4xx
        attempt = counted = 0
        while True:
            pending = await self._finish_exhausted(stitcher.unfinished())
            if not pending:
                await self._resp.write(stitcher.ending())
                return True
            attempt += 1
            if cause != Failure.MIGRATE:  # a planned move spends none of the resume budget
                counted += 1
            sent = {p.index: p.generated for p in pending}
            # A refusal needs no backend: checked before asking for one.
            why = next(filter(None, (refusal(self._client, p) for p in pending)), None)
            if why is not None:
                await self._oracle_failover(failed_backend, failure, exclude, ())
                return await self._give_up(
                    failed_backend, failure, attempt, FailoverOutcome.REFUSED, why
                )
            note = f"; refused by {', '.join(refusals)}" if refusals else ""
            if not self._budget.allows(max(counted - 1, 0), time.perf_counter() - detected):
                return await self._give_up(
                    failed_backend,
                    failure,
                    attempt,
                    FailoverOutcome.EXHAUSTED,
                    "resume budget exhausted" + note,
                )
            early: dict[int, Started] = {}
            backend = decided
            if backend is None:
                backend, early = await self._choose(failed_backend, failure, exclude, pending)
            decided = None
            if backend is None:
                reason = "no other backend available" + note
                return await self._give_up(
                    failed_backend, failure, attempt, FailoverOutcome.EXHAUSTED, reason
                )
            log.info(
                "request %s: %s failed (%s); resuming on %s",
                self._rid,
                failed_backend.id,
                failure,
                backend.id,
            )
            runs = [self._resumer.run(backend, p, detected, early.get(p.index)) for p in pending]
            try:
                # One choice, the usual case, needs no task: one event-loop turn less per gap.
                results = [await runs[0]] if len(runs) == 1 else list(await asyncio.gather(*runs))
            except BaseException:
                for started in early.values():  # a run cancelled before it began owns nothing
                    started.upstream.close()
                raise
            self._speak()  # in case the resume ended before its second write
            for p, r in zip(pending, results, strict=True):
                self._report(
                    r,
                    FailoverReport(
                        self._rid,
                        failed_backend.id,
                        backend.id,
                        failure,
                        p.index,
                        sent[p.index],
                        r.path,
                        r.seam,
                        r.gap_ms,
                        attempt,
                        FailoverOutcome.RESUMED if r.failure is None else FailoverOutcome.FAILED,
                        r.detail,
                    ),
                )
            self.served_by = backend
            broken = [r for r in results if r.failure is not None]
            if not broken:
                continue
            if any(r.gap_ms for r in results):
                # The client got resumed bytes since: a new failure starts a new gap (and
                # a new resume clock) from now.
                detected = time.perf_counter()
                self._detected_ns = time.time_ns()
            hard = [r for r in broken if r.failure != Failure.REJECTED]
            if not hard:
                # The backend refused our request, which says nothing of its health: skip
                # it, and keep reporting the original failure so control demotes nobody new.
                exclude.append(backend.id)
                refusals.append(f"{backend.id}: {broken[0].detail}")
                cause = Failure.REJECTED
                continue
            exclude.append(failed_backend.id)
            worst = next((r for r in hard if r.failure != Failure.MIGRATE), hard[0])
            failed_backend, failure = backend, worst.failure or "failure"
            cause = failure
            if failure == Failure.MIGRATE:
                decided = worst.handover

    async def _finish_exhausted(self, pending: list[ChoiceProgress]) -> list[ChoiceProgress]:
        """Ends with "length" every choice that was sent all its max_tokens before the
        failure (only its finish was lost): resuming would ask for max_tokens 0, which
        engines refuse. One whose engine held text back for a stop string still needs a
        backend to recover that text (Resumer does it). Returns the choices left."""
        left = []
        stops = bool(self._client.body.get("stop"))
        for p in pending:
            if tokens_left(self._client, p) != 0 or (stops and p.token_ids):
                left.append(p)
                continue
            p.finish_reason = "length"
            log.info("request %s: choice %d had all its tokens; finished", self._rid, p.index)
            await self._write(self.stitcher.chunk(p.index, "", [], "length"))
        return left

    async def _choose(
        self,
        failed_backend: Backend,
        failure: str,
        exclude: list[str],
        pending: list[ChoiceProgress],
    ) -> tuple[Backend | None, dict[int, Started]]:
        """Where to resume. Control was asked at route time already: the route's next
        fallback, in control's order, is its answer given in advance, so the resume opens
        there at once, and control is told afterwards (_tell_later). Control's Failover
        answer is waited for only when that fallback cannot take the resume: waiting for it
        would put a control round trip into every gap. Returns the backend and, when it is
        the fallback, the resumes already open there."""
        gone = {failed_backend.id, *exclude, *self._oracle.fleet.migrating}
        preferred = [b for b in self._fallbacks if b.id not in gone]
        ids = [b.id for b in preferred]
        if preferred:
            opened = await self._open_all(preferred[0], pending)
            if opened is not None:
                self._tell_later(failed_backend, failure, list(exclude), ids)
                return preferred[0], opened
        return await self._oracle_failover(failed_backend, failure, exclude, ids), {}

    def _tell_later(
        self, failed: Backend, failure: str, exclude: list[str], preferred: Sequence[str]
    ) -> None:
        """Control hears of the failure (and demotes the backend) once the resumed stream
        flows: at its second write, or CONTROL_AFTER_S from now if that comes first. Its
        call's work then stays out of the gap of this resume and of the other resumes the
        same failure started; its answer only keeps the books."""

        def tell() -> None:
            timer.cancel()
            self._keep(
                asyncio.ensure_future(self._oracle_failover(failed, failure, exclude, preferred))
            )

        self._speak()  # an earlier one still held back goes first
        timer = asyncio.get_running_loop().call_later(CONTROL_AFTER_S, self._speak)
        self._tell, self._told_after = tell, 0

    async def _open_all(
        self, backend: Backend, pending: list[ChoiceProgress]
    ) -> dict[int, Started] | None:
        """Every pending choice's resume opened on `backend`, or None (and nothing left
        open) if any could not be. One choice, the usual case, opens in this task: a task
        per start would cost event-loop turns in every gap."""
        exact = self._settings.seam_mode == "parallel"
        todo = [p for p in pending if tokens_left(self._client, p) != 0]
        if len(todo) == 1:
            try:
                return {todo[0].index: await self._resumer.start(backend, todo[0], exact=exact)}
            except (AttemptFailed, Refused):
                return None
        got = await asyncio.gather(
            *(self._resumer.start(backend, p, exact=exact) for p in todo), return_exceptions=True
        )
        if all(isinstance(g, Started) for g in got):
            return {p.index: g for p, g in zip(todo, got, strict=True) if isinstance(g, Started)}
        for g in got:
            if isinstance(g, Started):
                g.upstream.close()
        for g in got:
            if not isinstance(g, Started | AttemptFailed | Refused):
                raise g  # cancelled, or a bug: not a backend's refusal
        return None

    def _keep(self, task: asyncio.Future[Backend | None]) -> None:
        """Let control's late answer finish in the background (its failure is not ours)."""
        self._background.add(task)  # type: ignore[arg-type]

        def done(t: asyncio.Future[Backend | None]) -> None:
            self._background.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: a dead control is handled elsewhere

        task.add_done_callback(done)

    def _report(self, result: ChoiceResume, report: FailoverReport) -> None:
        if result.verdict is None:
            self._send(report)
            return

        async def when_checked(verdict: asyncio.Task[Seam]) -> None:
            seam = await verdict
            self._send(replace(report, seam=seam))

        task = asyncio.create_task(when_checked(result.verdict))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _send(self, report: FailoverReport) -> None:
        self._metrics.count(
            self._metrics.failovers, report.failure, report.seam or "none", report.outcome
        )
        if self._tracing.enabled:
            report = replace(report, trace_id=Tracing.trace_id())
            # One span per failover, from the failure to now (the seam verdict is known).
            span = self._tracing.tracer.start_span(
                "baton.failover",
                start_time=self._detected_ns or None,
                attributes={
                    "baton.request_id": report.request_id,
                    "baton.from_backend": report.from_backend,
                    "baton.to_backend": report.to_backend,
                    "baton.failure": report.failure,
                    "baton.choice": report.choice,
                    "baton.tokens_sent": report.tokens_sent,
                    "baton.resume_path": report.path,
                    "baton.seam": report.seam,
                    "baton.gap_ms": report.gap_ms,
                    "baton.attempt": report.attempt,
                    "baton.outcome": report.outcome,
                },
            )
            span.end()
        self._oracle.report_failover(report)

    async def _oracle_failover(
        self,
        failed: Backend,
        failure: str,
        exclude: list[str],
        preferred: Sequence[str],
    ) -> Backend | None:
        try:
            decision = await self._oracle.failover(
                self._rid,
                self._shape,
                failed.id,
                failure,
                exclude,
                preferred,
                self._tracing.traceparent() if self._tracing.enabled else "",
            )
        except ControlUnavailable:
            return None
        return decision.backends[0] if decision.backends else None

    async def _give_up(
        self, backend: Backend, failure: str, attempt: int, outcome: FailoverOutcome, why: str
    ) -> bool:
        for p in self.stitcher.unfinished():
            self._send(
                FailoverReport(
                    self._rid,
                    backend.id,
                    "",
                    failure,
                    p.index,
                    p.generated,
                    None,
                    None,
                    0.0,
                    attempt,
                    outcome,
                    why,
                )
            )
        kind = ErrorKind.BACKEND_FAILED
        message = f"backend {backend.id} failed mid-stream ({failure}) and the stream " + (
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
