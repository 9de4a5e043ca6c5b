"""One client stream, end to end: relay the first backend's events and, when that backend
fails mid-stream, resume every unfinished choice on another backend (resume.py plans it,
resumer.py runs one attempt, stitch.py shapes what the client sees). The client gets one
unbroken stream or an explicit error event; never a silently truncated one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import aiohttp
import orjson
from aiohttp import web

from control.model import Backend, RequestShape
from control.tracing import OFF, Tracing
from dataplane.errors import ErrorKind, OpenAIError
from dataplane.failover import Failure, RetryBudget
from dataplane.forward import Timeouts
from dataplane.metrics import ShimMetrics
from dataplane.oracle import ControlUnavailable, FailoverReport, Oracle
from dataplane.resume import Refused, Seam, plan_resume
from dataplane.resumer import TOKEN_KINDS, ChoiceResume, Resumer, Started, discard
from dataplane.settings import ResumeSettings
from dataplane.stitch import Stitcher
from dataplane.upstream_sse import StreamFailed, read_events
from dataplane.validate import ClientRequest

log = logging.getLogger("baton.shim.stream")

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
        tracing: Tracing = OFF,
    ) -> None:
        """`fallbacks`: the route decision's backends in order, control's preference for
        where to resume. `background`: the proxy's set of tasks that may outlive this
        request (a seam check still running when the stream ends)."""
        self._background = background
        self._metrics = metrics
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
        self._resumer = Resumer(
            session=session,
            timeouts=timeouts,
            settings=settings,
            client=client,
            stitcher=self.stitcher,
            write=self._write,
        )
        self.first_byte: float | None = None
        self.served_by: Backend | None = None

    async def run(self, backend: Backend, upstream: aiohttp.ClientResponse, first: bytes) -> bool:
        """True when the client got a complete answer, False when it got an error event."""
        self.served_by = backend
        try:
            await self._pump(upstream, first)
        except StreamFailed as failed:
            upstream.close()
            if self.stitcher.unfinished():
                return await self._failover(backend, failed)
            # Every choice had finished: only the tail (usage, [DONE]) was lost.
            self.stitcher.resumed = self.stitcher.usage is None
        await self._resp.write(self.stitcher.ending())
        return True

    async def _write(self, data: bytes) -> None:
        if self.first_byte is None:
            self.first_byte = time.monotonic()
        await self._resp.write(data)

    async def _pump(self, upstream: aiohttp.ClientResponse, first: bytes) -> None:
        original = self.stitcher.original
        async for events in read_events(upstream.content, first, self._settings, False):
            out: list[bytes] = []
            for event in events:
                if event.is_done:
                    if out:
                        await self._write(b"".join(out))
                    if self.stitcher.unfinished():
                        raise StreamFailed(Failure.TRUNCATED, "[DONE] before every choice finished")
                    return
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

    # -- failover ------------------------------------------------------------------------

    async def _failover(self, failed_backend: Backend, failed: StreamFailed) -> bool:
        stitcher = self.stitcher
        stitcher.resumed = True
        # perf_counter, not loop.time(): uvloop's loop clock ticks in whole milliseconds,
        # too coarse for a gap of a few ms.
        detected = time.perf_counter()
        self._detected_ns = time.time_ns()
        failure = failed.failure
        exclude: list[str] = []
        attempt = 0
        while True:
            pending = stitcher.unfinished()
            if not pending:
                await self._resp.write(stitcher.ending())
                return True
            attempt += 1
            sent = {p.index: p.generated for p in pending}
            try:
                for p in pending:  # a refusal needs no backend: check before asking for one
                    plan_resume(self._client, p, token_path=True, seam_tokens=0)
            except Refused as why:
                await self._oracle_failover(failed_backend, failure, exclude, ())
                return await self._give_up(failed_backend, failure, attempt, "refused", str(why))
            if not self._budget.allows(attempt - 1, time.perf_counter() - detected):
                return await self._give_up(
                    failed_backend, failure, attempt, "exhausted", "resume budget exhausted"
                )
            # Control decides where to resume, but it was already asked once: the route's
            # fallbacks are its preferred answer. Open the resume there while it decides; if
            # it picks another backend the early start is dropped.
            gone = {failed_backend.id, *exclude}
            preferred = [b for b in self._fallbacks if b.id not in gone]
            early: dict[int, asyncio.Task[Started]] = {}
            if preferred:
                exact = self._settings.seam_mode == "parallel"
                early = {
                    p.index: asyncio.create_task(self._resumer.start(preferred[0], p, exact=exact))
                    for p in pending
                }
            try:
                backend = await self._oracle_failover(
                    failed_backend, failure, exclude, [b.id for b in preferred]
                )
            except BaseException:
                for task in early.values():
                    discard(task)
                raise
            if backend is None or not preferred or backend.id != preferred[0].id:
                for task in early.values():
                    discard(task)
                early = {}
            if backend is None:
                return await self._give_up(
                    failed_backend, failure, attempt, "exhausted", "no other backend available"
                )
            log.info(
                "request %s: %s failed (%s); resuming on %s",
                self._rid,
                failed_backend.id,
                failure,
                backend.id,
            )
            results = await asyncio.gather(
                *(self._resumer.run(backend, p, detected, early.get(p.index)) for p in pending)
            )
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
                        r.path.value if r.path else "",
                        r.seam.value if r.seam else "",
                        r.gap_ms,
                        attempt,
                        "resumed" if r.failure is None else "failed",
                        r.detail,
                    ),
                )
            self.served_by = backend
            broken = [r for r in results if r.failure is not None]
            if broken:
                exclude.append(failed_backend.id)
                failed_backend, failure = backend, broken[0].failure or "failure"

    def _report(self, result: ChoiceResume, report: FailoverReport) -> None:
        if result.verdict is None:
            self._send(report)
            return

        async def when_checked(verdict: asyncio.Task[Seam]) -> None:
            seam = await verdict
            self._send(replace(report, seam=seam.value))

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
        self, failed: Backend, failure: str, exclude: list[str], preferred: Sequence[str]
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
        self, backend: Backend, failure: str, attempt: int, outcome: str, why: str
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
                    "",
                    "",
                    0.0,
                    attempt,
                    outcome,
                    why,
                )
            )
        kind = ErrorKind.BACKEND_FAILED
        message = f"backend {backend.id} failed mid-stream ({failure}) and the stream " + (
            f"cannot be resumed: {why}" if outcome == "refused" else f"was not resumed: {why}"
        )
        await self._resp.write(OpenAIError(kind, message).sse())
        return False


def with_token_ids(client: ClientRequest, backend: Backend, raw: bytes) -> bytes:
    """The first attempt's body: ask token-id engines for ids, so a failure can resume
    token-exact. Other backends get the client's bytes untouched."""
    if not client.stream or backend.kind not in TOKEN_KINDS or client.body.get("return_token_ids"):
        return raw
    return orjson.dumps({**client.body, "return_token_ids": True})
