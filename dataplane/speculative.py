"""Serve one request by router-level speculative decoding (specplan.py has the rules).

Each round is two short non-streaming calls (draft: k tokens; target: score draft + one
token), so the request is naturally resumable: a target that dies between or during rounds
is replaced through control's Failover, which re-pairs the draft with the new target. Such a
new pairing runs one probe round whose tokens are held back until control's gate answers;
a rejected pairing never emits anything (DESIGN §6).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from baton.model import (
    Backend,
    Decision,
    FailoverOutcome,
    FailoverReport,
    Pairing,
    RequestOutcome,
    RequestShape,
    ResumePath,
    Seam,
    SpecStats,
)
from dataplane.engine import detokenize, post_json
from dataplane.errors import ErrorKind, OpenAIError
from dataplane.exceptions import AttemptFailed, ControlUnavailable, DraftFailed
from dataplane.failover import Failure, RetryBudget
from dataplane.oracle import FailoverAdvice, FailoverAudit, Gate, Outcomes
from dataplane.resume import detok
from dataplane.settings import Timeouts
from dataplane.shape import reply_hash
from dataplane.spec_answer import AnswerWriter
from dataplane.specplan import Judged, judge, repeated_ngram
from dataplane.validate import ClientRequest, Endpoint, token_limit

log = logging.getLogger("baton.shim.spec")



class SpecControl(FailoverAdvice, FailoverAudit, Gate, Outcomes, Protocol):
    """What speculative serving asks of control: re-pairing after a target's failure (the
    gate), failovers, and the request's outcome."""


@dataclass(slots=True)
class SpecRun:
    """One request's state across rounds and failovers."""

    request_id: str
    client: ClientRequest
    shape: RequestShape
    target: Backend
    pairing: Pairing | None
    ctx: list[int] = field(default_factory=list)  # prompt ids + everything emitted
    prompt_len: int = 0
    generated: list[int] = field(default_factory=list)
    text: str = ""  # detokenised `generated`, as far as sent
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tried: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    moving: Move | None = None  # a failover whose first resumed byte has not been sent yet


@dataclass(frozen=True, slots=True)
class Move:
    """A target that failed mid-stream, until the failover's outcome is known."""

    from_backend: str
    failure: str
    detected: float  # monotonic
    tokens_sent: int
    attempt: int


class SpecServer:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        oracle: SpecControl,
        timeouts: Timeouts,
        budget: RetryBudget,
    ) -> None:
        self._session = session
        self._oracle = oracle
        self._timeouts = timeouts
        self._budget = budget

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
        run.ctx = await self._prompt_ids(run.target, client)
        run.prompt_len = len(run.ctx)
        limit = token_limit(client.body) or 0
        if decision.pairing.gate_required:
            await self._gate_first(run, limit)
        writer = AnswerWriter(request, client, request_id)
        finish = "length"
        try:
            while len(run.generated) < limit:
                judged = await self._next(run, limit - len(run.generated))
                last = bool(judged.finished) or len(run.generated) + len(judged.emitted) >= limit
                await self._emit(run, writer, judged.emitted, last=last)
                if judged.finished:
                    finish = judged.finished
                    break
        except OpenAIError as err:
            self._moved(run, FailoverOutcome.EXHAUSTED, str(err))
            await writer.fail(err)
            self._finished(run, ok=False)
            return writer.response
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: no more rounds, and control must stop counting it.
            self._finished(run, ok=False)
            raise
        self._moved(run, FailoverOutcome.RESUMED)  # a resume that ended without new text
        await writer.finish(finish, run.prompt_len, len(run.generated))
        self._finished(run, ok=True)
        return writer.response

    # -- rounds ----------------------------------------------------------------------------

    async def _next(self, run: SpecRun, remaining: int) -> Judged:
        """The next tokens, from a round on the pair or target-only, surviving target death
        through failovers (bounded)."""
        while True:
            try:
                if run.pairing is None:
                    return await self._target_only(run, remaining)
                try:
                    judged, drafted = await self._round(run, run.pairing, run.target, remaining)
                except DraftFailed as exc:
                    log.info("request %s: draft failed (%s); target-only", run.request_id, exc)
                    run.pairing = None
                    continue
                run.rounds += 1
                run.drafted += drafted
                run.accepted += judged.accepted
                return judged
            except AttemptFailed as failed:
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
            decision = await self._oracle.failover(
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
        run.rounds = run.drafted = run.accepted = 0  # acceptance is per pairing
        if run.pairing is not None and run.pairing.gate_required:
            await self._gate_first(run, remaining)

    async def _gate_first(self, run: SpecRun, remaining: int) -> None:
        """A new pairing: one probe round, judged by control before anything it verified is
        used. The probe's tokens are discarded either way (the next round recomputes them
        from the same context, so nothing is lost but the round's time)."""
        pairing = run.pairing
        assert pairing is not None
        try:
            judged, drafted = await self._round(run, pairing, run.target, remaining)
        except DraftFailed:
            run.pairing = None
            return
        try:
            answer = await self._oracle.gate_pairing(
                run.request_id, pairing.pair_id, run.target.id, drafted, judged.accepted
            )
        except ControlUnavailable:
            run.pairing = None  # fail closed: no verdict, no pairing
            return
        log.info("request %s: pairing %s on %s: %s (%s)", run.request_id, pairing.pair_id,
                 run.target.id, answer.verdict, answer.reason)  # fmt: skip
        if answer.verdict == "reject":
            if answer.target is not None:
                run.target = answer.target  # re-bound: its facts match; serve there
                run.pairing = Pairing(pairing.pair_id, pairing.draft, pairing.num_draft_tokens,
                                      pairing.params_hash, False, pairing.eos_token_id)  # fmt: skip
            else:
                run.pairing = None

    async def _round(
        self, run: SpecRun, pairing: Pairing, target: Backend, remaining: int
    ) -> tuple[Judged, int]:
        k = max(1, min(pairing.num_draft_tokens, remaining))
        try:
            proposal = await self._complete(pairing.draft, run.ctx, k)
        except AttemptFailed as exc:
            raise DraftFailed(exc.failure, exc.detail) from exc
        draft_ids = _ints(proposal.get("token_ids"))
        if draft_ids is None:
            raise DraftFailed(Failure.GARBAGE, "draft sent no token_ids")
        scored = await self._complete(target, run.ctx + draft_ids, 1, prompt_logprobs=1)
        try:
            judged = judge(
                draft_ids,
                scored["prompt_logprobs"],
                _ints(scored.get("token_ids")) or [],
                scored.get("finish_reason"),
                remaining,
                pairing.eos_token_id,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AttemptFailed(Failure.GARBAGE, f"scoring answer: {exc}") from None
        return judged, len(draft_ids)

    async def _target_only(self, run: SpecRun, remaining: int) -> Judged:
        """No usable draft: the target generates the rest greedily in one call."""
        choice = await self._complete(run.target, run.ctx, remaining)
        ids = _ints(choice.get("token_ids"))
        if ids is None:
            raise AttemptFailed(Failure.GARBAGE, "target sent no token_ids")
        finish = choice.get("finish_reason")
        return Judged(0, tuple(ids[:remaining]), "stop" if finish == "stop" else "length")

    # -- backend calls ---------------------------------------------------------------------

    async def _complete(
        self, backend: Backend, prompt: list[int], n: int, prompt_logprobs: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": backend.model,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "return_token_ids": True,
        }
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        answer = await self._post(backend, "/v1/completions", body)
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise AttemptFailed(Failure.GARBAGE, "completion without choices") from None
        if not isinstance(choice, dict):
            raise AttemptFailed(Failure.GARBAGE, "completion choice is not an object")
        return choice

    async def _prompt_ids(self, target: Backend, client: ClientRequest) -> list[int]:
        body = client.body
        prompt = body.get("prompt")
        if client.endpoint is Endpoint.COMPLETIONS and (given := _ints(prompt)) is not None:
            return list(given)
        ask: dict[str, Any] = {"model": target.model}
        if client.endpoint is Endpoint.CHAT:
            ask.update(messages=body["messages"], add_generation_prompt=True)
        elif isinstance(prompt, str):
            ask["prompt"] = prompt
        else:
            raise AttemptFailed(Failure.GARBAGE, "prompt is neither text nor token ids")
        ids = _ints((await self._post(target, "/tokenize", ask)).get("tokens"))
        if ids is None:
            raise AttemptFailed(Failure.GARBAGE, "tokenize sent no tokens")
        return ids

    async def _detokenize(self, target: Backend, ids: list[int]) -> str:
        return await detokenize(self._session, target, target.model, ids, self._timeouts.connect)

    async def _post(self, backend: Backend, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await post_json(self._session, backend, path, body, self._timeouts)

    # -- client side -----------------------------------------------------------------------

    async def _emit(
        self, run: SpecRun, writer: AnswerWriter, ids: tuple[int, ...], *, last: bool = False
    ) -> None:
        """Send the text `ids` add, as the target would stream it: only up to whole
        characters (detok), and at the end up to the last character boundary."""
        run.generated.extend(ids)
        run.ctx.extend(ids)
        if not ids and not last:
            return
        while True:
            try:
                decode = functools.partial(self._detokenize, run.target)
                if last:
                    text = await detok.settled(decode, run.generated)
                else:
                    text = await decode(run.generated)
                break
            except AttemptFailed as failed:
                await self._failover(run, failed, 1)
        if not (last or detok.whole(text)):
            return  # half a character: the rest comes with the next round
        if text.startswith(run.text) and len(text) > len(run.text):
            delta = text[len(run.text) :]
            run.text = text
            if run.first_byte is None:
                run.first_byte = time.monotonic()
            await writer.text(delta)
            self._moved(run, FailoverOutcome.RESUMED)

    def _moved(self, run: SpecRun, outcome: FailoverOutcome, detail: str = "") -> None:
        """The audit event of a pending failover: `resumed` once the new target's text reached
        the client, `failed` when it failed too, `exhausted` when the request ends in an error.
        The resume is by ids from the exact context, so there is no overlap to check."""
        move, run.moving = run.moving, None
        if move is None:
            return
        resumed = outcome is FailoverOutcome.RESUMED
        self._oracle.report_failover(
            FailoverReport(
                request_id=run.request_id,
                from_backend=move.from_backend,
                to_backend=run.target.id if outcome is not FailoverOutcome.EXHAUSTED else "",
                failure=move.failure,
                choice=0,
                tokens_sent=move.tokens_sent,
                path=ResumePath.TOKEN,
                seam=Seam.UNCHECKED if resumed else None,
                gap_ms=(time.monotonic() - move.detected) * 1000 if resumed else 0.0,
                attempt=move.attempt,
                outcome=outcome,
                detail=detail or "speculative pair's target",
            )
        )

    def _finished(self, run: SpecRun, ok: bool) -> None:
        now = time.monotonic()
        first = run.first_byte or now
        chat = run.client.endpoint is Endpoint.CHAT
        stats = None
        if run.pairing is not None or run.rounds:
            pair_id = run.pairing.pair_id if run.pairing else ""
            stats = SpecStats(pair_id, run.target.id, run.rounds, run.drafted, run.accepted,
                              repeated_ngram(run.generated))  # fmt: skip
        self._oracle.finished(
            RequestOutcome(
                run.request_id,
                run.target.id,
                run.client.model,
                ok,
                200 if ok else 502,
                ttft_ms=(first - run.started) * 1000,
                total_ms=(now - run.started) * 1000,
                reply_chain_hash=reply_hash(run.shape.prefix_chain, run.text)
                if ok and chat
                else b"",
                message_count=run.shape.message_count,
                spec=stats if stats is not None and stats.pair_id else None,
            )
        )


def _ints(v: Any) -> list[int] | None:
    """A list of token ids, or None when it is anything else."""
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    return None
