"""Where a failover resumes, and when control hears of it. Control was asked at route time
already: the route's next fallback, in control's order, is its answer given in advance, so
the resume opens there at once and control is told once the resumed stream flows
(_tell_later); control's Failover answer is waited for only when no fallback can take it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from baton.model import Backend, Failure
from dataplane.exceptions import AttemptFailed, ControlUnavailable, Refused
from dataplane.link.needs import FailoverAdvice
from dataplane.relay.context import StreamContext
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume.attempt import Resumer, Started, tokens_left
from dataplane.relay.resume.generate import opens_exact

# Longest a Failover call waits for the resumed stream to flow (see Chooser._tell_later).
CONTROL_AFTER_S = 0.1


class Chooser:
    def __init__(self, ctx: StreamContext, *, control: FailoverAdvice, resumer: Resumer) -> None:
        self._control = control
        self._resumer = resumer
        self._settings = ctx.settings
        self._client = ctx.client
        self._rid = ctx.request_id
        self._shape = ctx.shape
        self._fallbacks = ctx.fallbacks
        self._tracing = ctx.tracing
        self._background = ctx.background
        # A Failover call held back until the resumed stream flows (see _tell_later), and the
        # resumed writes since it was.
        self._tell: Callable[[], None] | None = None
        self._told_after = 0

    def wrote(self) -> None:
        """The relay wrote to the client: a held-back Failover call goes at the second write."""
        if self._tell is not None:
            self._told_after += 1
            if self._told_after >= 2:
                self.speak()

    def speak(self) -> None:
        """Make the Failover call held back for the resume (see _tell_later), if one is."""
        tell, self._tell = self._tell, None
        if tell is not None:
            tell()

    async def choose(
        self,
        failed_backend: Backend,
        failure: Failure,
        exclude: list[str],
        pending: list[ChoiceProgress],
    ) -> tuple[Backend | None, dict[int, Started]]:
        """Where to resume. Control was asked at route time already: the route's next
        fallback, in control's order, is its answer given in advance, so the resume opens
        there at once, and control is told afterwards (_tell_later). Control's Failover
        answer is waited for only when that fallback cannot take the resume: waiting for it
        would put a control round trip into every gap. Returns the backend and, when it is
        the fallback, the resumes already open there."""
        gone = {failed_backend.id, *exclude, *self._control.fleet.migrating}
        preferred = [b for b in self._fallbacks if b.id not in gone]
        ids = [b.id for b in preferred]
        if preferred:
            opened = await self._open_all(preferred[0], pending)
            if opened is not None:
                self._tell_later(failed_backend, failure, list(exclude), ids)
                return preferred[0], opened
        return await self.ask(failed_backend, failure, exclude, ids), {}

    def _tell_later(
        self, failed: Backend, failure: Failure, exclude: list[str], preferred: Sequence[str]
    ) -> None:
        """Control hears of the failure (and demotes the backend) once the resumed stream
        flows: at its second write, or CONTROL_AFTER_S from now if that comes first. Its
        call's work then stays out of the gap of this resume and of the other resumes the
        same failure started; its answer only keeps the books."""

        def tell() -> None:
            timer.cancel()
            self._keep(asyncio.ensure_future(self.ask(failed, failure, exclude, preferred)))

        self.speak()  # an earlier one still held back goes first
        timer = asyncio.get_running_loop().call_later(CONTROL_AFTER_S, self.speak)
        self._tell, self._told_after = tell, 0

    async def _open_all(
        self, backend: Backend, pending: list[ChoiceProgress]
    ) -> dict[int, Started] | None:
        """Every pending choice's resume opened on `backend`, or None (and nothing left
        open) if any could not be. One choice, the usual case, opens in this task: a task
        per start would cost event-loop turns in every gap."""
        exact = opens_exact(self._settings.seam_mode, self._client)
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

        def done(t: asyncio.Future[Backend | None]) -> None:
            if not t.cancelled():
                t.exception()  # retrieved: a dead control is handled elsewhere

        self._background.spawn(task, done)

    async def ask(
        self,
        failed: Backend,
        failure: Failure,
        exclude: list[str],
        preferred: Sequence[str],
    ) -> Backend | None:
        try:
            decision = await self._control.failover(
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
