"""One resumed stream relayed to the client: each chunk through the inline seam check, the
text Baton derives from ids where the prompt ended mid-character, and Baton's stop strings,
into the stitcher; a migration can start at any chunk boundary. Resumer
(dataplane/relay/resume/attempt.py) opens the stream and decides what to do with how it ended."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from baton.model import AttemptEnd, Backend, Failure, ResumePath, Seam
from dataplane.exceptions import StreamFailed
from dataplane.relay import logprobs
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume.seam import HeldText, SeamCheck
from dataplane.relay.resume.sidecheck import ResumeWatch
from dataplane.relay.resume.stops import StopMatcher
from dataplane.relay.stitch import Stitcher
from dataplane.request import Endpoint
from dataplane.settings import ResumeSettings
from dataplane.upstream.chunks import (
    FAILED_FINISH,
    Choice,
    choice_text,
    error_type,
    parse_chunk,
)
from dataplane.upstream.engine import each_event

Decode = Callable[[Backend, list[int]], Awaitable[str]]


class Downstream(Protocol):
    """What a resume needs of the relay that owns the client's stream (relay.StreamRelay):
    the client's stream to write to, a place for a finished resume's response, and where a
    stream on a backend drained with --migrate should go."""

    async def write(self, data: bytes) -> None:
        """Bytes for the client, in order."""
        ...

    def keep(self, upstream: aiohttp.ClientResponse) -> None:
        """A resume whose generation is over: its connection is settled (engine.settle) once
        the client's answer is complete."""
        ...

    def due(self, backend_id: str) -> bool:
        """Is `backend_id` drained with migration, and is it time to ask where to go?
        Cheap: asked at every chunk."""
        ...

    async def target(self, backend: Backend) -> Backend | None:
        """Control's choice of a backend to move to; None: stay."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceResume:
    """How one choice's resume on one backend went."""

    path: ResumePath | None = None
    seam: Seam | None = None
    gap_ms: float = 0.0
    failure: Failure | None = None
    detail: str = ""
    verdict: asyncio.Task[Seam] | None = None  # a parallel seam check still running
    handover: Backend | None = None  # failure "migrate": where control said to move it


@dataclass(slots=True)
class ResumeState:
    """A resume's result as it forms (the resumer and the resumed stream write it), and the
    side check's watch on it; `result()` is what the relay is handed."""

    path: ResumePath | None = None
    seam: Seam | None = None
    gap_ms: float = 0.0
    failure: Failure | None = None
    detail: str = ""
    verdict: asyncio.Task[Seam] | None = None
    handover: Backend | None = None
    watch: ResumeWatch = field(default_factory=ResumeWatch)

    def result(self) -> ChoiceResume:
        return ChoiceResume(path=self.path, seam=self.seam, gap_ms=self.gap_ms,
                            failure=self.failure, detail=self.detail, verdict=self.verdict,
                            handover=self.handover)  # fmt: skip


class ResumedStream:
    def __init__(
        self,
        *,
        settings: ResumeSettings,
        stitcher: Stitcher,
        downstream: Downstream,
        decode: Decode,
        settled_decode: Decode,
    ) -> None:
        self._settings = settings
        self._stitcher = stitcher
        self._down = downstream
        self._decode = decode
        self._settled_decode = settled_decode

    async def relay(
        self,
        backend: Backend,
        upstream: aiohttp.ClientResponse,
        p: ChoiceProgress,
        endpoint: Endpoint,
        seam: SeamCheck,
        held: HeldText | None,
        stops: StopMatcher | None,
        detected: float,
        result: ResumeState,
    ) -> AttemptEnd:
        """Relays one resumed stream to its end: FINISHED, STOPPED or DIVERGENT (never
        FAILED: a failure raises StreamFailed)."""
        chat = endpoint is Endpoint.CHAT
        stitcher = self._stitcher
        # Logprob entries not yet sent, one per token, aligned with the ids the seam check
        # holds (the overlap's are dropped with its ids).
        pending: list[dict[str, Any]] | None = [] if stitcher.logprobs_k is not None else None
        async for event in each_event(upstream, self._settings):
            if event.is_done:
                break
            ch = self._choice(event.data, p)
            if ch is None:
                continue
            finish = ch.finish_reason
            ids = ch.token_ids or []
            text = choice_text(ch, chat)
            if pending is not None:
                pending += logprobs.entries_of(ch.logprobs)
            verified = seam.feed(ids, text, finish is not None)
            if seam.verdict is Seam.DIVERGENT:
                return AttemptEnd.DIVERGENT
            if verified is None:
                continue
            ids, text = verified
            entries = None
            if pending is not None:
                entries = pending[len(pending) - len(ids) :] if ids else []
                pending.clear()
            stop_reason = ch.stop_reason
            if not result.watch.first_seen.is_set():
                result.watch.saw(ids, text)
            settled = False
            if held is not None:
                text, settled = await self._release(backend, held, ch, chat, ids)
                if settled:
                    held = None
            engine_finish = finish
            if stops is not None:
                text, finish, stop_reason = _apply_stops(stops, text, finish, stop_reason)
            cut = None
            end_at = stitcher.thinking.needs_cut(p, ids, text)
            if end_at is not None:
                cut = await self._thinking_cut(backend, p, ids, end_at, text)
            out = stitcher.resumed_chunk(
                p, text, ids, finish, stop_reason, settled=settled, cut=cut, entries=entries
            )
            if out:
                await self._send(out, result, detected)
            if finish:
                return AttemptEnd.FINISHED if engine_finish else AttemptEnd.STOPPED
            # A chunk boundary, everything so far sent: a migration can start here.
            if self._down.due(backend.id):
                await self._move(backend, result)
        raise StreamFailed(Failure.TRUNCATED, "resumed stream ended before finishing")

    async def _release(
        self, backend: Backend, held: HeldText, ch: Choice, chat: bool, ids: list[int]
    ) -> tuple[str, bool]:
        """The text to send for a chunk while Baton derives the text from ids: never the
        engine's text here, only its word that it released some. True once settled."""
        held.add(ids)
        finish = ch.finish_reason
        if not (text_released(ch, chat) or finish):
            return "", False
        resolved = await self._resolve(backend, held, finish, ch.stop_reason)
        return (resolved, True) if resolved is not None else ("", False)

    async def _thinking_cut(
        self, backend: Backend, p: ChoiceProgress, ids: list[int], end_at: int, text: str
    ) -> int:
        """How much of a resumed chunk's `text` comes before the end tag at generated index
        `end_at`, whose text the stream skips (Thinking.needs_cut): the text of the ids before
        the tag, decoded from the last character boundary before it, less what the client
        has of it. Raises StreamFailed (REFUSED) when the ids' text does not lead up to the
        chunk's: the split could not be kept faithfully."""
        generated = p.ids() + ids
        at, text_at = 0, 0
        if p.settles:
            at, text_at = next(((a, t) for a, t in reversed(p.settled) if a <= end_at), (0, 0))
        before = await self._decode(backend, generated[at:end_at])
        sent = p.text[text_at:]
        part = before[len(sent) :] if before.startswith(sent) else None
        if part is None or not text.startswith(part):
            raise StreamFailed(
                Failure.REFUSED,
                "the end of thinking could not be placed in the resumed text: "
                f"its ids decode to {before[-16:]!r} where the stream has {(sent + text)[-16:]!r}",
            )
        return len(part)

    async def _send(self, out: bytes, result: ResumeState, detected: float) -> None:
        if result.gap_ms == 0.0:
            result.gap_ms = (time.perf_counter() - detected) * 1000
        await self._down.write(out)

    def _choice(self, data: bytes, p: ChoiceProgress) -> Choice | None:
        """The resumed chunk's one choice (a resume asks for one); None for a chunk without
        one (usage). Raises StreamFailed for garbage or an engine's error finish."""
        chunk, failure = parse_chunk(data, 1)
        if chunk is None:
            if failure is Failure.ERROR_EVENT:
                raise StreamFailed(failure, error_type(data))
            raise StreamFailed(failure or Failure.GARBAGE)
        if not chunk.choices:
            self._note_usage(chunk.usage, p)
            return None
        ch = chunk.choices[0]
        finish = ch.finish_reason
        if finish in FAILED_FINISH:
            raise StreamFailed(Failure.finish(finish))
        return ch

    async def _move(self, backend: Backend, result: ResumeState) -> None:
        """`backend` is drained with migration: raises StreamFailed(MIGRATE) when control
        names a backend to move to (result.handover); else the stream stays."""
        result.handover = await self._down.target(backend)
        if result.handover is not None:
            raise StreamFailed(Failure.MIGRATE, f"{backend.id} drained with migration")

    def _note_usage(self, usage: dict[str, Any] | None, p: ChoiceProgress) -> None:
        if usage and self._stitcher.extra_prompt_tokens is None:
            # Text path: the resume's prompt includes the text already sent.
            self._stitcher.extra_prompt_tokens = max(0, usage.get("prompt_tokens", 0) - p.generated)

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


def _apply_stops(
    stops: StopMatcher, text: str, finish: str | None, stop_reason: object
) -> tuple[str, str | None, object]:
    """Baton's stop strings over a resume it derives the text of: the text to send, and the
    finish (a matched stop string ends the choice with "stop", the string as its reason)."""
    text, matched = stops.feed(text)
    if matched is not None:
        return text, "stop", matched
    if finish:
        text += stops.flush()
    return text, finish, stop_reason


def text_released(ch: Choice, chat: bool) -> bool:
    """Whether a resumed chunk carries text: a byte-level engine releases text only at a
    character boundary, so this says when decoding the held tokens is worth a call."""
    return bool(choice_text(ch, chat))
