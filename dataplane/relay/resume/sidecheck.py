"""The seam's verdict beside the resumed stream (parallel seam mode): would the new backend
regenerate the overlap the client already has (one short non-streaming request over the
shared prefix), and is the text the engine sent first after a resume at a character
boundary the text of its ids. Run once the resume has ended, so it never competes with it
for the engine's compute or memory (ResumeWatch.ended)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from baton.model import Backend, Seam
from dataplane.exceptions import AttemptFailed
from dataplane.relay.resume import detok
from dataplane.relay.resume.plan import ResumePlan
from dataplane.upstream.chunks import choice_text_whole
from dataplane.upstream.engine import complete_once


@dataclass(slots=True)
class ResumeWatch:
    """What the side check reads of a resume as it runs: the one object the resumed stream
    (which sets it) and the side check (which waits on it) share."""

    # Set once the resumed stream has ended (finished, stopped or failed). The check waits
    # for it, since its verdict is only reported then anyway: beside a running resume it
    # competes for the engine's memory as well as its compute. llama-server's slots share
    # one KV cache, and a check re-prefilling the shared prefix beside a resume that nearly
    # fills the context made the engine fail both ("Context size has been exceeded": the
    # check killed the stream it was checking).
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    # An exact resume at a character boundary: the ids and the engine's text of its first
    # chunks up to the first that carried text (set once they are in, or at the stream's
    # end).
    first_text: tuple[list[int], str] = field(default_factory=lambda: ([], ""))
    first_seen: asyncio.Event = field(default_factory=asyncio.Event)

    def saw(self, ids: list[int], text: str) -> None:
        """A chunk of the resumed stream, until one carries text."""
        seen_ids, _ = self.first_text
        seen_ids.extend(ids)
        if text:
            self.first_text = (seen_ids, text)
            self.first_seen.set()


class SideCheck:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        decode: Callable[[Backend, list[int]], Awaitable[str]],
        total_timeout: float,
    ) -> None:
        self._session = session
        self._decode = decode
        self._timeout = total_timeout

    async def verdict(
        self,
        backend: Backend,
        check: ResumePlan | None,
        resume: ResumeWatch,
        first: bool,
        base: Seam,
    ) -> Seam:
        """`check`: the overlap to regenerate; `first`: compare the engine's first text with
        its ids' text. `base`: the verdict when there is no overlap to check."""
        await resume.ended.wait()
        verdict = await self._overlap(backend, check) if check is not None else base
        if first and not await self._first_text_agrees(backend, resume):
            return Seam.DIVERGENT
        return verdict

    async def _first_text_agrees(self, backend: Backend, resume: ResumeWatch) -> bool:
        """Unknown (the call failed) counts as agreeing: the verdict stays what the overlap
        says, never a guess of divergence."""
        await resume.first_seen.wait()
        ids, text = resume.first_text
        if not text:
            return True
        try:
            decoded = await self._decode(backend, ids)
        except AttemptFailed:
            return True
        # A chunk of several tokens may end with half a character held back.
        return decoded == text or (not detok.whole(decoded) and decoded.startswith(text))

    async def _overlap(self, backend: Backend, check: ResumePlan) -> Seam:
        body = {**check.body, "stream": False, "max_tokens": check.overlap_tokens}
        for name in ("min_tokens", "stream_options"):
            body.pop(name, None)
        choice = await complete_once(
            self._session, backend, check.endpoint.value, body, self._timeout
        )
        if choice is None:
            return Seam.UNCHECKED
        text = choice_text_whole(choice)
        if check.overlap_ids:
            # An overlap at a character boundary: the engine's text for it must be the
            # client's, byte for byte, as well as its ids. One that may start mid-character
            # is checked by its ids alone (the engine's text there is not the ids' own; the
            # resume derives it from ids and checks that against the client's).
            ids = tuple(choice.get("token_ids") or ())
            same = ids == check.overlap_ids and (
                text == check.overlap_text or not check.overlap_has_text
            )
            return Seam.VERIFIED if same else Seam.DIVERGENT
        prefill = _assistant_prefill(check.body)
        if prefill and text.startswith(prefill):
            # Some engines (llama-server) answer a continued assistant turn, when not
            # streaming, with the prefill and the new text together.
            text = text[len(prefill) :]
        return text_verdict(text, check.overlap_text)


def _assistant_prefill(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not (body.get("continue_final_message") and isinstance(messages, list) and messages):
        return ""
    content = messages[-1].get("content") if isinstance(messages[-1], dict) else None
    return content if isinstance(content, str) else ""


def text_verdict(got: str, want: str) -> Seam:
    """A text-path overlap check. A shorter answer that is a prefix of what the client has
    proves nothing either way (an engine may put several tokens in one chunk)."""
    if got == want:
        return Seam.VERIFIED
    return Seam.UNCHECKED if want.startswith(got) else Seam.DIVERGENT
