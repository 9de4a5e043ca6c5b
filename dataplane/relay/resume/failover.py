"""A stream's failover: once its backend failed mid-stream (or was drained with migration),
resume every unfinished choice on another backend, round after round, until all have
finished or the resume budget is spent (choose.py picks where, plan.py plans it, attempt.py
runs one attempt, reports.py tells control). The relay (dataplane/relay/stream.py) hands a
failed stream over here and gets back whether the client's answer is complete; the client
gets one unbroken stream or an explicit error event, never a silently truncated one."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from baton.model import Backend, FailoverOutcome, FailoverReport, Failure
from dataplane.exceptions import ErrorKind, OpenAIError, StreamFailed
from dataplane.relay.context import StreamContext
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume.attempt import Resumer, Started, ends_here
from dataplane.relay.resume.choose import Chooser
from dataplane.relay.resume.plan import refusal
from dataplane.relay.resume.reports import Reporter
from dataplane.relay.resume.resumed import ChoiceResume
from dataplane.relay.stitch import Stitcher
from dataplane.settings import RetryBudget
from dataplane.sse import ClientStream

log = logging.getLogger("baton.shim.stream")


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


class Failover:
    def __init__(
        self,
        ctx: StreamContext,
        *,
        stitcher: Stitcher,
        resumer: Resumer,
        chooser: Chooser,
        reporter: Reporter,
        resp: ClientStream,
    ) -> None:
        self._rid = ctx.request_id
        self._client = ctx.client
        self._budget = RetryBudget(ctx.settings.max_resumes, ctx.settings.max_resume_seconds)
        self.stitcher = stitcher
        self._resumer = resumer
        self._chooser = chooser
        self._reporter = reporter
        self._resp = resp
        self.served_by: Backend | None = None  # the backend of the last round's resumes

    async def run(
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
            if ends_here(self._client, p, self.stitcher.tools is not None):
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


