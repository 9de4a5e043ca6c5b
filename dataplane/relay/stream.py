"""One client stream, end to end: relay the first backend's events to the client (the
stitcher shapes what the client sees: dataplane/relay/stitch.py) and, when that backend fails
mid-stream or is drained with migration, hand the stream to its failover
(dataplane/relay/resume/failover.py), the one seam between the happy path and the resume."""

from __future__ import annotations

import asyncio
import functools
import os
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from baton.model import Backend, Failure
from dataplane.exceptions import AttemptFailed, StreamFailed
from dataplane.link.needs import FailoverAdvice, FailoverAudit
from dataplane.outcomes import cached_count
from dataplane.relay import runs
from dataplane.relay.context import StreamContext
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume.attempt import TOKEN_KINDS, Resumer
from dataplane.relay.resume.choose import Chooser
from dataplane.relay.resume.failover import Failover
from dataplane.relay.resume.migration import Migration
from dataplane.relay.resume.reports import Reporter
from dataplane.relay.stitch import Stitcher
from dataplane.request import ClientRequest, Endpoint
from dataplane.sse import ClientStream, Event, whole_event
from dataplane.sse import event as sse_event
from dataplane.upstream.chunks import error_type
from dataplane.upstream.engine import upstream_blocks


class RelayControl(FailoverAdvice, FailoverAudit, Protocol):
    """What a stream's relay asks of control: where to go, and the failover's report."""


@dataclass(frozen=True, slots=True)
class Relayed:
    """What a relayed stream was, once it ended: all the proxy reports of it (the outcome
    control hears, the span's attributes), read here so nothing outside the relay reads the
    stitcher."""

    complete: bool  # the client got a whole answer (else an error event)
    served_by: Backend  # the backend that finished it
    reply: str | None  # a complete answer's first choice, the next turn's prefix
    first_choice: ChoiceProgress | None  # its token ids, for the KV blocks it implies
    finishes: tuple[str | None, ...]
    response_id: str | None
    model: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt, as the engine's usage said (priced apart)


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
        self._failover = Failover(
            ctx, stitcher=self.stitcher, resumer=self._resumer, chooser=self._chooser,
            reporter=Reporter(control, ctx.metrics, ctx.tracing, ctx.background,
                              ctx.shape.tenant), resp=resp,
        )  # fmt: skip
        self.first_byte: float | None = None
        self._started_on: Backend | None = None
        self._first = b""  # the first stream's first read, until its reader takes it

    @property
    def served_by(self) -> Backend | None:
        """The backend that finished the stream: the last to resume it, or the first."""
        return self._failover.served_by or self._started_on

    async def run(self, backend: Backend, upstream: aiohttp.ClientResponse, first: bytes) -> bool:
        """True when the client got a complete answer, False when it got an error event."""
        self._started_on = backend
        self.stitcher.follow_tools(
            backend.tool_parser,
            functools.partial(tool_call_id, backend.tool_parser),
            reasoning=bool(backend.reasoning_parser),
        )
        parser = backend.reasoning_parser
        if parser and self.stitcher.chat:
            markers = await self._markers.get(backend) if self._markers is not None else None
            self.stitcher.follow_reasoning(parser, markers)
        self._first = first
        del first  # (parsed once by _pump's reader, then let go: it can be a burst)
        try:
            target = await self._pump(backend, upstream)
        except StreamFailed as failed:
            upstream.close()
            if self.stitcher.unfinished():
                return await self._failover.run(backend, failed)
            # Every choice had finished: only the tail (usage, [DONE]) was lost.
            self.stitcher.resumed = self.stitcher.usage is None
        else:
            if target is not None:
                # Planned: stopped at a chunk boundary; closing stops the old generation.
                upstream.close()
                moved = StreamFailed(Failure.MIGRATE, f"{backend.id} drained with migration")
                return await self._failover.run(backend, moved, target)
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
            reply=first.reply if complete and first is not None else None,
            first_choice=first,
            finishes=tuple(c.finish_reason for c in st.choices.values()),
            response_id=st.ident.id,
            model=st.ident.model,
            prompt_tokens=inputs,
            completion_tokens=outputs,
            cached_tokens=cached_count(st.usage),
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

    async def _pump(self, backend: Backend, upstream: aiohttp.ClientResponse) -> Backend | None:
        """Relays the first stream to its end. Returns where to move it when `backend` is
        drained with migration (decided between two reads: a chunk boundary).

        Each block of whole events (engine.read_blocks) is answered with one write. Once the
        stream's first chunk has gone out, a block's plain token chunks go as one run
        (_events, Stitcher.plain_run); every other event is taken here, one at a time."""
        first, self._first = self._first, b""
        blocks = upstream_blocks(upstream, first, self._settings)
        del first
        stitcher = self.stitcher
        original = stitcher.original
        async for block in blocks:
            out: list[bytes] = []
            try:
                # One event a read (a quiet engine's pace): nothing to split or run.
                one = block.find(b"\n\n") == len(block) - 2
                for event in (whole_event(block),) if one else self._events(block, out):
                    if not event.data:
                        continue  # a keep-alive comment
                    if event.is_done:
                        if stitcher.unfinished():
                            raise StreamFailed(Failure.TRUNCATED,
                                               "[DONE] before every choice finished")  # fmt: skip
                        return None
                    piece, failure = original(event.data, event.raw)
                    if stitcher.wants:
                        # A tag chunk the engine's parser mis-split: split by ids (once a
                        # stream).
                        try:
                            texts = await self._resumer.cut_texts(backend, stitcher.wants)
                        except AttemptFailed as failed:
                            # The engine cannot say (it died right after the chunk, as seen on
                            # a SIGKILL): the chunk is dropped, untracked, and the stream fails
                            # over before it; the resume splits those tokens by ids itself.
                            raise StreamFailed(failed.failure, failed.detail) from None
                        piece, failure = original(event.data, event.raw, texts)
                    if piece:
                        if self.first_byte is None and not failure:
                            # The client's first token goes out now, not after the rest of a
                            # read that may hold the whole answer (a fast engine's): that is
                            # its TTFT. uvloop sends what was written when the loop next
                            # turns, so turn it.
                            await self.write(piece)
                            await asyncio.sleep(0)
                        else:
                            out.append(piece)
                    if failure:
                        why = error_type(event.data) if failure == Failure.ERROR_EVENT else ""
                        raise StreamFailed(failure, why)
            finally:
                # What one read delivered goes out in one write (before a failure's too).
                if out:
                    await self.write(b"".join(out))
            del out, block  # not held while the next read waits
            if self.due(backend.id):  # a chunk boundary: a migration can start here
                target = await self.target(backend)
                if target is not None:
                    return target
        return None

    def _events(self, block: bytes, out: list[bytes]) -> Iterator[Event]:
        """The events of a block for _pump to take one at a time; a run of plain chunks
        among them (tried once a block, once the stream's first chunk went out) is taken
        here, into `out`, between two of them."""
        raws = block.split(b"\n\n")
        raws.pop()  # b"": a block ends with a blank line
        i, n, tried = 0, len(raws), False
        while i < n:
            if not tried and self.stitcher.plain and self.first_byte is not None:
                tried = True
                i = self._run(block, raws, i, out)
                continue
            yield sse_event(raws[i])
            i += 1

    def _run(self, block: bytes, raws: list[bytes], i: int, out: list[bytes]) -> int:
        """Events i.. of the block up to the last that looks plain, as one run when they
        all are: where the events left to offer one by one start."""
        k = len(raws)
        while k > i and not runs.looks_plain(raws[k - 1]):  # a finish, usage, [DONE]...
            k -= 1
        if k - i < 2:
            return i
        start = sum(map(len, raws[:i])) + 2 * i
        stop = len(block) - sum(map(len, raws[k:])) - 2 * (len(raws) - k)
        run = block[start:stop] if start or stop < len(block) else block
        piece = self.stitcher.plain_run(run, k - i)
        if piece is None:
            return i
        out.append(piece)
        return k


_ALNUM = string.ascii_letters + string.digits


def tool_call_id(parser: str) -> str:
    """A tool call's id as the engine's parser makes one, for the calls a resume starts:
    vLLM's make_tool_call_id ("chatcmpl-tool-" and 16 hex digits), or Mistral's 9 letters
    and digits."""
    if parser == "mistral":
        return "".join(_ALNUM[b % len(_ALNUM)] for b in os.urandom(9))
    return "chatcmpl-tool-" + os.urandom(8).hex()


# The APIs whose streams carry token ids when asked (the others' streams are relayed).
TOKEN_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})


def with_token_ids(client: ClientRequest, backend: Backend, raw: bytes) -> bytes:
    """The first attempt's body: ask token-id engines for ids, so a failure can resume
    token-exact. Other backends get the client's bytes untouched."""
    if (
        not client.stream
        or client.endpoint not in TOKEN_ENDPOINTS
        or backend.kind not in TOKEN_KINDS
        or client.body.get("return_token_ids")
    ):
        return raw
    # The body parsed as a JSON object, so its last non-blank byte is its closing brace: the
    # key goes in before it, with no re-serialising of what may be a long prompt. A client's
    # own `"return_token_ids": false` is overridden, as engines keep the last of a repeated key.
    end = raw.rstrip()
    return end[:-1] + b',"return_token_ids":true}'
