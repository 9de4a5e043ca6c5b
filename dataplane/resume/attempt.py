"""One choice's resume on one backend: plan it, open it (possibly before control has
answered), relay its chunks through the seam check and the stop strings, and have the seam
verified beside it when asked to (sidecheck.py). StreamRelay (relay.py) decides when and
where; this module does one attempt."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

from baton.model import Backend, BackendKind, ResumePath, Seam
from dataplane.engine import (
    AttemptFailed,
    StreamFailed,
    Timeouts,
    detokenize,
    each_event,
    error_kind,
    open_attempt,
    resume_failure,
)
from dataplane.failover import Failure
from dataplane.resume import detok
from dataplane.resume.plan import Refused, ResumePlan, plan_resume, tokens_allowed
from dataplane.resume.progress import ChoiceProgress
from dataplane.resume.seam import HeldText, SeamCheck
from dataplane.resume.sidecheck import SideCheck
from dataplane.resume.stitch import (
    FAILED_FINISH,
    Stitcher,
    StopMatcher,
    choice_text,
    parse_chunk,
)
from dataplane.settings import ResumeSettings
from dataplane.validate import ClientRequest, Endpoint

TOKEN_KINDS = frozenset({BackendKind.VLLM, BackendKind.SGLANG})


class Handover(Protocol):
    """Where a stream on a backend drained with --migrate should go (StreamRelay answers)."""

    def due(self, backend_id: str) -> bool:
        """Is `backend_id` drained with migration, and is it time to ask where to go?
        Cheap: asked at every chunk."""
        ...

    async def target(self, backend: Backend) -> Backend | None:
        """Control's choice of a backend to move to; None: stay."""
        ...


@dataclass(slots=True)
class ChoiceResume:
    """How one choice's resume on one backend went."""

    path: ResumePath | None = None
    seam: Seam | None = None
    gap_ms: float = 0.0
    failure: str | None = None
    detail: str = ""
    verdict: asyncio.Task[Seam] | None = None  # a parallel seam check still running
    handover: Backend | None = None  # failure "migrate": where control said to move it
    # Set at the resumed stream's second event (or its end). The seam check waits for it: on
    # a card that prefills one request at a time it would otherwise delay the resume itself,
    # and the resumes the same failure sent there (their first tokens come before this
    # stream's second).
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    # An exact resume at a character boundary: the ids and the engine's text of its first
    # chunks up to the first that carried text, for the side check (set once they are in,
    # or at the stream's end).
    first_text: tuple[list[int], str] = field(default_factory=lambda: ([], ""))
    first_seen: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class Started:
    """A resume request that is open: its plan, its response and, in parallel mode, the
    plan of the seam check to run beside it."""

    plan: ResumePlan
    upstream: aiohttp.ClientResponse
    check: ResumePlan | None


class Resumer:
    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        timeouts: Timeouts,
        settings: ResumeSettings,
        client: ClientRequest,
        stitcher: Stitcher,
        write: Callable[[bytes], Awaitable[None]],
        handover: Handover,
        trailers: list[aiohttp.ClientResponse],
    ) -> None:
        """`trailers`: where a finished resume's response goes, for the owner to settle
        (upstream_sse.settle) once the client's answer is complete."""
        self._handover = handover
        self._trailers = trailers
        self._session = session
        self._timeouts = timeouts
        self._settings = settings
        self._client = client
        self._stitcher = stitcher
        self._write = write
        self._side = SideCheck(session, self._decode, settings.max_resume_seconds)

    async def start(self, backend: Backend, p: ChoiceProgress, *, exact: bool) -> Started:
        """Plan and open one resume request. Raises Refused or AttemptFailed. The plans are
        taken from `p` as it is now, before any resumed token is added to it."""
        token_path = backend.kind in TOKEN_KINDS
        m = self._settings.seam_tokens
        plan = plan_resume(self._client, p, token_path=token_path, seam_tokens=m, exact=exact)
        check = None
        if exact and self._settings.seam_mode == "parallel":
            candidate = plan_resume(self._client, p, token_path=token_path, seam_tokens=m)
            check = candidate if candidate.seam is Seam.VERIFIED else None
        upstream = await self._open(backend, plan.endpoint, plan.body)
        return Started(plan, upstream, check)

    async def run(
        self,
        backend: Backend,
        p: ChoiceProgress,
        detected: float,
        early: Started | None = None,
    ) -> ChoiceResume:
        """Resume `p` on `backend` to its end. `early`: a start() already open there (this
        call owns it from now on)."""
        result = ChoiceResume()
        if tokens_left(self._client, p) == 0:
            if early is not None:
                early.upstream.close()
            return await self._finish_exhausted(backend, p, result)
        exact = self._settings.seam_mode == "parallel"
        verify: asyncio.Task[Seam] | None = None
        try:
            while True:
                try:
                    started = early or await self.start(backend, p, exact=exact)
                except Refused as why:
                    result.failure, result.detail = Failure.REFUSED, str(why)
                    return result
                except AttemptFailed as failed:
                    result.failure, result.detail = failed.failure, failed.detail
                    return result
                early = None
                plan = started.plan
                result.path = plan.path
                # An exact token resume at a character boundary passes the engine's text on:
                # checked beside the stream against the ids' own text.
                at_boundary = (
                    plan.path is ResumePath.TOKEN and plan.held is None and not plan.checks
                    and bool(p.token_ids)
                )  # fmt: skip
                if (started.check is not None or at_boundary) and verify is None:
                    base: Seam = plan.seam if plan.seam is not Seam.VERIFIED else Seam.UNCHECKED
                    if result.seam is not None:
                        base = result.seam  # a divergent try keeps its verdict
                    verify = asyncio.create_task(
                        self._side.verdict(backend, started.check, result, at_boundary, base)
                    )
                elif result.seam is None and verify is None:  # a divergent try keeps its verdict
                    result.seam = plan.seam if plan.seam is not Seam.VERIFIED else None
                if not at_boundary:
                    result.first_seen.set()  # nothing to watch
                seam = SeamCheck(plan.overlap_ids, plan.overlap_text)
                outcome = ""
                stops = (
                    StopMatcher(
                        _stops(self._client),
                        bool(self._client.body.get("include_stop_str_in_output")),
                    )
                    if plan.held is not None and _stops(self._client)
                    else None
                )
                held = HeldText(plan.held) if plan.held is not None else None
                try:
                    outcome = await self._relay_resumed(
                        backend, started.upstream, p, plan.endpoint, seam, held, stops, detected,
                        result,
                    )
                except StreamFailed as failed:
                    result.failure, result.detail = failed.failure, str(failed)
                    return result
                except AttemptFailed as failed:  # decoding the held tokens' text failed
                    result.failure, result.detail = failed.failure, failed.detail
                    return result
                finally:
                    result.flowing.set()  # a stream that ended early: the check may go now
                    result.first_seen.set()
                    if outcome == "finished":  # its generation is over: keep the connection
                        self._trailers.append(started.upstream)
                    else:
                        started.upstream.close()  # also stops a generation still running
                if outcome == "divergent":
                    result.seam, exact = Seam.DIVERGENT, True
                    continue
                if held is not None and held.verdict is Seam.DIVERGENT:
                    result.seam = Seam.DIVERGENT  # the side check's verdict cannot undo it
                    if verify is not None:
                        verify.cancel()
                        verify = None
                if verify is not None:
                    # Reported when it lands; the client's stream need not wait for it.
                    result.verdict, verify = verify, None
                elif result.seam is None:
                    result.seam = seam.verdict
                return result
        finally:
            if verify is not None:  # the resume failed: its verdict no longer matters
                verify.cancel()
            if early is not None:  # never relayed
                early.upstream.close()

    async def _finish_exhausted(
        self, backend: Backend, p: ChoiceProgress, result: ChoiceResume
    ) -> ChoiceResume:
        """Every token the client asked for was sent, only the finish was lost: end the
        choice with "length" as the engine would have, releasing the text it held back for
        a possible stop string. Resuming would ask for max_tokens 0, which engines refuse."""
        held = ""
        stops = backend.kind in TOKEN_KINDS and bool(_stops(self._client))
        pending = p.held(from_start=True) if stops else None
        if pending is not None:
            try:
                decoded = await self._settled_decode(backend, list(pending.ids))
            except AttemptFailed as failed:
                result.failure, result.detail = failed.failure, failed.detail
                return result
            held = HeldText(pending).resolve(decoded, True) or ""
        if held:
            p.pieces.append(held)  # its tokens are in p.token_ids already: not add()
        p.finish_reason = "length"
        await self._write(self._stitcher.chunk(p.index, held, [], "length"))
        result.detail = "max_tokens reached before the failure; finished without a resume"
        return result

    async def _relay_resumed(
        self,
        backend: Backend,
        upstream: aiohttp.ClientResponse,
        p: ChoiceProgress,
        endpoint: Endpoint,
        seam: SeamCheck,
        held: HeldText | None,
        stops: StopMatcher | None,
        detected: float,
        result: ChoiceResume,
    ) -> str:
        """Relays one resumed stream to its end: "finished" (the engine ended it), "stopped"
        (Baton matched a stop string; the engine is still generating) or "divergent" (the
        inline seam check failed). Raises StreamFailed."""
        chat = endpoint is Endpoint.CHAT
        stitcher = self._stitcher
        events = 0
        async for event in each_event(upstream.content, self._settings):
            events += 1
            if events == 2:
                result.flowing.set()
            data = event.data
            if event.is_done:
                break
            obj, failure = parse_chunk(data, 1)  # a resume asks for one choice
            if obj is None:
                raise StreamFailed(failure or Failure.GARBAGE)
            choices = obj.get("choices") or []
            if not choices:
                usage = obj.get("usage")
                if usage and stitcher.extra_prompt_tokens is None:
                    # Text path: the resume's prompt includes the text already sent.
                    stitcher.extra_prompt_tokens = max(
                        0, usage.get("prompt_tokens", 0) - p.generated
                    )
                continue
            ch = choices[0]
            finish = ch.get("finish_reason")
            if finish in FAILED_FINISH:
                raise StreamFailed(Failure.finish(finish))
            ids = ch.get("token_ids") or []
            text = choice_text(ch, chat)
            verified = seam.feed(ids, text, finish is not None)
            if seam.verdict is Seam.DIVERGENT:
                return "divergent"
            if verified is None:
                continue
            ids, text = verified
            stop_reason = ch.get("stop_reason")
            if not result.first_seen.is_set():
                seen_ids, seen_text = result.first_text
                seen_ids.extend(ids)
                if text:
                    result.first_text = (seen_ids, text)
                    result.first_seen.set()
            settled = False
            if held is not None:
                # Never the engine's text here: only its word that it released some.
                held.add(ids)
                text, resolved = "", None
                if text_released(ch, chat) or finish:
                    resolved = await self._resolve(backend, held, finish, stop_reason)
                if resolved is not None:
                    text, settled, held = resolved, True, None
            engine_finish = finish
            if stops is not None:
                text, matched = stops.feed(text)
                if matched is not None:
                    finish, stop_reason = "stop", matched
                elif finish:
                    text += stops.flush()
            p.add(text, ids, settled=settled)
            if finish:
                p.finish_reason, p.stop_reason = finish, stop_reason
            out = stitcher.chunk(p.index, text, ids, finish, stop_reason)
            if out:
                if result.gap_ms == 0.0:
                    result.gap_ms = (time.perf_counter() - detected) * 1000
                await self._write(out)
            if finish:
                return "finished" if engine_finish else "stopped"
            # A chunk boundary, everything so far sent: a migration can start here.
            if self._handover.due(backend.id):
                result.handover = await self._handover.target(backend)
                if result.handover is not None:
                    raise StreamFailed(Failure.MIGRATE, f"{backend.id} drained with migration")
        raise StreamFailed(Failure.TRUNCATED, "resumed stream ended before finishing")

    async def _open(
        self, backend: Backend, endpoint: Endpoint, body: dict[str, object]
    ) -> aiohttp.ClientResponse:
        upstream = await open_attempt(
            self._session, backend, endpoint.value, orjson.dumps(body), self._timeouts
        )
        status = upstream.status
        if status == 200:
            return upstream
        why = await error_kind(upstream, self._timeouts.connect)
        upstream.close()
        raise AttemptFailed(resume_failure(status), f"resume answered {status}{why}")

    async def _resolve(
        self, backend: Backend, held: HeldText, finish: str | None, stop_reason: object
    ) -> str | None:
        """The held tokens' text once it is whole characters (HeldText.resolve)."""
        ids = held.ids
        if finish == "stop" and not isinstance(stop_reason, str) and ids:
            ids = ids[:-1]  # EOS or a stop token id: engines release no text for it
        if finish:
            decoded = await self._settled_decode(backend, ids)
        else:
            decoded = await self._decode(backend, ids)
        return held.resolve(decoded, finish is not None)

    async def _settled_decode(self, backend: Backend, ids: list[int]) -> str:
        return await detok.settled(functools.partial(self._decode, backend), ids)

    async def _decode(self, backend: Backend, ids: list[int]) -> str:
        """The new engine's own text for `ids`."""
        return await detokenize(
            self._session, backend, self._client.model, ids, self._timeouts.connect
        )


def tokens_left(client: ClientRequest, p: ChoiceProgress) -> int | None:
    """Tokens the client still allows this choice (None: no limit). A text-path count
    undercounts (a chunk can carry several tokens), so 0 here is never premature."""
    return tokens_allowed(client.body, p.generated)


def text_released(ch: dict[str, Any], chat: bool) -> bool:
    """Whether a resumed chunk carries text: a byte-level engine releases text only at a
    character boundary, so this says when decoding the held tokens is worth a call."""
    return bool(choice_text(ch, chat))


def _stops(client: ClientRequest) -> list[str]:
    stop = client.body.get("stop")
    if isinstance(stop, str):
        return [stop]
    return list(stop or [])
