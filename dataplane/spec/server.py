"""Serve one request by router-level speculative decoding (plan.py has the rules).

Each round is two short non-streaming calls (draft: k tokens; target: score draft + one
token), so the request is naturally resumable: a target that dies between or during rounds
is replaced through control's Failover, which re-pairs the draft with the new target. Such a
new pairing runs one probe round whose tokens are held back until control's gate answers;
a rejected pairing never emits anything (docs/architecture.md#speculative-pairs-and-the-gate).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import replace
from typing import Protocol

import aiohttp
from aiohttp import web

from baton.model import (
    Decision,
    FailoverOutcome,
    Pairing,
    RequestShape,
    Verdict,
)
from dataplane.exceptions import (
    AttemptFailed,
    ControlUnavailable,
    DraftFailed,
    ErrorKind,
    OpenAIError,
)
from dataplane.link.needs import FailoverAdvice, FailoverAudit, Gate, Outcomes
from dataplane.metrics import ShimMetrics
from dataplane.relay.resume import detok
from dataplane.request import ClientRequest, token_limit
from dataplane.settings import RetryBudget, SpecSettings, Timeouts
from dataplane.spec.answer import AnswerWriter
from dataplane.spec.plan import Judged, next_k
from dataplane.spec.rounds import Round, Rounds
from dataplane.spec.run import Move, SpecRun, failover_report, request_outcome

log = logging.getLogger("baton.shim.spec")


class SpecControl(FailoverAdvice, FailoverAudit, Gate, Outcomes, Protocol):
    """What speculative serving asks of control: re-pairing after a target's failure (the
    gate), failovers, and the request's outcome."""


class SpecServer:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        control: SpecControl,
        timeouts: Timeouts,
        budget: RetryBudget,
        metrics: ShimMetrics,
        settings: SpecSettings,
    ) -> None:
        self._control = control
        self._budget = budget
        self._metrics = metrics
        self._settings = settings
        self._rounds = Rounds(session, timeouts)

    async def serve(
        self,
        request: web.Request,
        request_id: str,
        client: ClientRequest,
        shape: RequestShape,
        decision: Decision,
    ) -> web.StreamResponse:
        """Raises AttemptFailed before anything reached the client (the caller then serves
        the request the ordinary way); afterwards every failure ends in a resumed stream or
        an explicit error event, never a truncated one."""
        assert decision.pairing is not None
        run = SpecRun(request_id, client, shape, decision.backends[0], decision.pairing)
        run.ctx = await self._rounds.prompt_ids(run.target, client)
        run.prompt_len = len(run.ctx)
        limit = token_limit(client.body) or 0
        if decision.pairing.gate_required:
            await self._gate_first(run, limit)
        writer = AnswerWriter(request, client, request_id)
        finish = "length"
        try:
            while len(run.generated) < limit:
                judged, done = await self._next(run, limit - len(run.generated))
                last = bool(judged.finished) or len(run.generated) + len(judged.emitted) >= limit
                detokenize_s = await self._emit(run, writer, judged.emitted, last=last)
                if done is not None:
                    self._metrics.spec_round(
                        done.draft_s, done.verify_s, detokenize_s, time.monotonic() - done.started,
                        ahead=done.from_ahead, drafted=done.drafted,
                    )  # fmt: skip
                if judged.finished:
                    finish = judged.finished
                    break
        except OpenAIError as err:
            self._moved(run, FailoverOutcome.EXHAUSTED, str(err))
            await writer.fail(err)
            self._control.finished(request_outcome(run, ok=False))
            return writer.response
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: no more rounds, and control must stop counting it.
            self._control.finished(request_outcome(run, ok=False))
            raise
        finally:
            run.drop_ahead()
        self._moved(run, FailoverOutcome.RESUMED)  # a resume that ended without new text
        await writer.finish(finish, run.prompt_len, len(run.generated))
        self._control.finished(request_outcome(run, ok=True))
        return writer.response

    # -- rounds ----------------------------------------------------------------------------

    async def _next(self, run: SpecRun, remaining: int) -> tuple[Judged, Round | None]:
        """The next tokens, from a round on the pair (returned too) or target-only,
        surviving target death through failovers (bounded)."""
        while True:
            try:
                pairing = run.pairing
                if pairing is None:
                    return await self._rounds.target_only(run.ctx, run.target, remaining), None
                k = run.k or pairing.num_draft_tokens
                most = self._settings.most_draft_tokens(pairing.num_draft_tokens)
                # What the next round drafts if this one is taken whole: the guess ahead.
                k_ahead = next_k(k, 1, 1, most) if self._settings.lookahead else 0
                try:
                    done = await self._rounds.round(
                        run.ctx, pairing, run.target, remaining,
                        k=k, ahead=run.ahead, k_ahead=k_ahead,
                    )  # fmt: skip
                except DraftFailed as exc:
                    log.warning("request %s: draft failed (%s); target-only", run.request_id, exc)
                    run.drop_ahead()
                    run.pairing = None
                    continue
                run.ahead = done.ahead
                if self._settings.adaptive_k:
                    run.k = next_k(k, done.drafted, done.judged.accepted, most)
                run.rounds += 1
                run.drafted += done.drafted
                run.accepted += done.judged.accepted
                return done.judged, done
            except AttemptFailed as failed:
                run.drop_ahead()
                await self._failover(run, failed, remaining)

    async def _failover(self, run: SpecRun, failed: AttemptFailed, remaining: int) -> None:
        # The last resume failed before it sent anything: that attempt is over.
        self._moved(run, FailoverOutcome.FAILED, str(failed))
        run.moving = Move(run.target.id, failed.failure, time.monotonic(),
                          len(run.generated), len(run.tried) + 1)  # fmt: skip
        run.tried.append(run.target.id)
        if not self._budget.allows(len(run.tried), time.monotonic() - run.started):
            raise OpenAIError(ErrorKind.BACKEND_FAILED, f"resume budget exhausted ({failed})")
        try:
            decision = await self._control.failover(
                run.request_id,
                run.shape,
                run.target.id,
                failed.failure,
                exclude=run.tried,
                pair_id=run.pairing.pair_id if run.pairing else "",
            )
        except ControlUnavailable as exc:
            raise OpenAIError(ErrorKind.BACKEND_FAILED, f"cannot resume: {exc}") from None
        if not decision.backends:
            raise OpenAIError(ErrorKind.BACKEND_FAILED, f"no backend to resume on ({failed})")
        log.info("request %s: %s failed (%s); resuming on %s", run.request_id, run.target.id,
                 failed, decision.backends[0].id)  # fmt: skip
        run.target = decision.backends[0]
        run.pairing = decision.pairing
        run.rounds = run.drafted = run.accepted = run.k = 0  # acceptance is per pairing
        run.drop_ahead()
        if run.pairing is not None and run.pairing.gate_required:
            await self._gate_first(run, remaining)

    async def _gate_first(self, run: SpecRun, remaining: int) -> None:
        """A new pairing: one probe round, judged by control before anything it verified is
        used. The probe's tokens are discarded either way (the next round recomputes them
        from the same context, so nothing is lost but the round's time)."""
        pairing = run.pairing
        assert pairing is not None
        try:
            probe = await self._rounds.round(run.ctx, pairing, run.target, remaining,
                                             k=pairing.num_draft_tokens)  # fmt: skip
        except DraftFailed as exc:
            log.warning("request %s: draft failed in the probe round of %s on %s (%s); "
                        "target-only", run.request_id, pairing.pair_id, run.target.id,
                        exc)  # fmt: skip
            run.pairing = None
            return
        try:
            answer = await self._control.gate_pairing(
                run.request_id, pairing.pair_id, run.target.id, probe.drafted,
                probe.judged.accepted,
            )
        except ControlUnavailable as exc:
            log.warning("request %s: no gate verdict on %s with %s (%s); target-only",
                        run.request_id, pairing.pair_id, run.target.id, exc)  # fmt: skip
            run.pairing = None  # fail closed: no verdict, no pairing
            return
        log.info("request %s: pairing %s on %s: %s (%s)", run.request_id, pairing.pair_id,
                 run.target.id, answer.verdict, answer.reason)  # fmt: skip
        if answer.verdict is Verdict.REJECT:
            if answer.target is not None:
                run.target = answer.target  # re-bound: its facts match; serve there
                run.pairing = Pairing(pairing.pair_id, pairing.draft, pairing.num_draft_tokens,
                                      pairing.params_hash, False)  # fmt: skip
            else:
                run.pairing = None

    # -- client side -----------------------------------------------------------------------

    async def _emit(
        self, run: SpecRun, writer: AnswerWriter, ids: tuple[int, ...], *, last: bool = False
    ) -> float:
        """Send the text `ids` add, as the target would stream it: only up to whole
        characters (detok), and at the end up to the last character boundary. Returns the
        seconds spent waiting for the target's detokenize."""
        run.generated.extend(ids)
        run.ctx.extend(ids)
        if not ids and not last:
            return 0.0
        asked = time.monotonic()
        while True:
            try:
                decode = functools.partial(self._rounds.detokenize, run.target)
                if last:
                    text = await detok.settled(decode, run.generated)
                else:
                    text = await decode(run.generated)
                break
            except AttemptFailed as failed:
                await self._failover(run, failed, 1)
        waited = time.monotonic() - asked
        if not (last or detok.whole(text)):
            return waited  # half a character: the rest comes with the next round
        if text.startswith(run.text) and len(text) > len(run.text):
            delta = text[len(run.text) :]
            run.text = text
            if run.first_byte is None:
                run.first_byte = time.monotonic()
            await writer.text(delta)
            self._moved(run, FailoverOutcome.RESUMED)
        return waited

    def _moved(self, run: SpecRun, outcome: FailoverOutcome, detail: str = "") -> None:
        """Report the pending failover, if one is (run.py's failover_report)."""
        move, run.moving = run.moving, None
        if move is not None:
            report = failover_report(run, move, outcome, detail)
            self._control.report_failover(replace(report, tenant=run.shape.tenant))
