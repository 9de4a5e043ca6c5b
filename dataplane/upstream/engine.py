"""Talking to an engine over HTTP: open a request and return the response once its status
line has arrived, or raise AttemptFailed with the failure class (open_attempt, post_json);
read its SSE stream with stall detection, every way a stream can break (a stall, a reset,
EOF, an oversized event) coming out as one StreamFailed with its class (read_events); and
give a finished stream's connection back to the pool (settle). Nothing here decides whether
to retry (dataplane/upstream/failures.py, resume/) or touches the client
(dataplane/edge/proxy.py)."""

from __future__ import annotations

import asyncio
import functools
import os
from array import array
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson

from baton.model import Backend, Failure
from dataplane.exceptions import AttemptFailed, StreamFailed
from dataplane.settings import ResumeSettings, Timeouts
from dataplane.sse import Event, SSEParser, events_of
from dataplane.upstream import buffers
from dataplane.upstream.chunks import error_type
from dataplane.upstream.failures import classify_status

JSON_HEADERS = {"Content-Type": "application/json"}


def classify_exception(exc: BaseException) -> AttemptFailed:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return AttemptFailed(Failure.CONNECT, str(exc.os_error.strerror or exc.os_error))
    if isinstance(exc, TimeoutError):
        return AttemptFailed(Failure.TIMEOUT, "backend did not answer in time")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return AttemptFailed(Failure.DISCONNECT, type(exc).__name__)
    return AttemptFailed(Failure.DISCONNECT, f"{type(exc).__name__}: {exc}")


async def open_attempt(
    session: aiohttp.ClientSession,
    backend: Backend,
    path: str,
    body: bytes,
    timeouts: Timeouts,
    headers: dict[str, str] | None = None,
) -> aiohttp.ClientResponse:
    """The caller owns the returned response and must release or close it. `headers`:
    extra ones (the trace context, so the engine's own spans join the request's trace).
    Headers are built here from scratch: nothing of the client's request (its Authorization
    above all) goes upstream; the backend gets its own key, when it has one."""
    extra = {**(headers or {}), **backend.call_headers(os.environ)}
    try:
        return await session.post(
            backend.url + path,
            data=body,
            headers={**JSON_HEADERS, **extra} if extra else JSON_HEADERS,
            timeout=_client_timeout(timeouts.connect, timeouts.read),
        )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise classify_exception(exc) from exc


@functools.lru_cache(maxsize=8)
def _client_timeout(connect: float, read: float) -> aiohttp.ClientTimeout:
    """One per setting, not one built per request (a microsecond each)."""
    return aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)


async def call(
    session: aiohttp.ClientSession,
    backend: Backend,
    method: str,
    path: str,
    timeouts: Timeouts,
) -> tuple[int, bytes, str]:
    """One whole bodiless request (a stored response's retrieve, delete or cancel): status,
    body and content type. Raises AttemptFailed when the backend does not answer."""
    try:
        async with session.request(
            method,
            backend.url + path,
            headers=backend.call_headers(os.environ) or None,
            timeout=_client_timeout(timeouts.connect, timeouts.read),
        ) as resp:
            body = await resp.read()
            return resp.status, body, resp.headers.get("Content-Type", "application/json")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise classify_exception(exc) from exc


# A finished stream's last bytes (the chunked terminator, a resume's usage and [DONE]) are read
# for at most this long and this much before its connection is given back to the pool.
TRAILER_SECONDS = 0.25
TRAILER_BYTES = 64 * 1024


# A read is parsed and handed on this much at a time. A fast engine's read can hold a whole
# socket buffer (hundreds of KiB, a thousand events): parsed at once, dozens of streams'
# events live together, and the small objects they leave freed keep the allocator's arenas
# resident (bench.memory: ~75 KiB a stream). A slice still carries a hundred token events,
# so a write per slice costs nothing a write per read did not.
READ_SLICE = 16 * 1024


async def read_blocks(
    content: aiohttp.StreamReader, first: bytes, settings: ResumeSettings, got_token: bool
) -> AsyncIterator[bytes]:
    """The whole events of each read (of each READ_SLICE of it) as one block of bytes
    (SSEParser.feed_block), when it has a data event: the caller answers it with one write,
    and a run of plain token chunks in it is handled as a whole. Raises StreamFailed on a
    stall, a broken connection, or EOF (the caller decides whether EOF was early). One lazy
    timer per stream (_StallWatch)."""
    parser = SSEParser()
    watch = _StallWatch(asyncio.get_running_loop(), content)
    chunk = first
    del first
    try:
        while True:
            for at in range(0, len(chunk), READ_SLICE):
                piece = chunk[at : at + READ_SLICE] if len(chunk) > READ_SLICE else chunk
                block = parser.feed_block(piece)
                del piece
                if block.startswith(b"data:") or b"\ndata:" in block:
                    got_token = True
                    # Not timed while the caller handles events: time spent writing to a slow
                    # client is backpressure, not a stalled backend.
                    watch.pause()
                    yield block
                    del block
            # Nothing of a read is held while waiting for the next (a stream that waits on
            # its client or engine holds no burst of events, nor the read they came in).
            chunk = b""
            watch.expect(
                settings.inter_token_timeout if got_token else settings.first_token_timeout
            )
            chunk = await content.readany()
            if not chunk:
                raise StreamFailed(Failure.TRUNCATED, "stream ended before [DONE]")
    except TimeoutError:
        raise StreamFailed(Failure.STALL, "no data within the stall timeout") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise StreamFailed(Failure.DISCONNECT, type(exc).__name__) from None
    except ValueError as exc:  # an SSE event over the size limit
        raise StreamFailed(Failure.GARBAGE, str(exc)) from None
    finally:
        watch.close()


async def read_events(
    content: aiohttp.StreamReader, first: bytes, settings: ResumeSettings, got_token: bool
) -> AsyncIterator[list[Event]]:
    """read_blocks split into their data events (keep-alive comments dropped), a batch a
    block."""
    async for block in read_blocks(content, first, settings, got_token):
        events = [e for e in events_of(block) if e.data]
        del block
        if events:
            yield events


class _StallWatch:
    """Fails a stream's pending read with TimeoutError once no data has come for its limit.

    One timer per stream, re-armed only when it comes due, not per read: a read just moves
    the deadline on. Rescheduling a timer per token (asyncio.timeout's reschedule, twice a
    read) cost 2.7 µs of the ~14 µs a relayed token costs the shim."""

    __slots__ = ("_loop", "_content", "_due", "_at", "_handle")

    def __init__(self, loop: asyncio.AbstractEventLoop, content: aiohttp.StreamReader) -> None:
        self._loop = loop
        self._content = content
        self._due: float | None = None  # None: paused
        self._at = 0.0  # when the armed timer fires
        self._handle: asyncio.TimerHandle | None = None

    def expect(self, limit: float) -> None:
        """A read is about to wait: it fails unless data comes within `limit` seconds."""
        due = self._loop.time() + limit
        self._due = due
        if self._handle is not None and self._at <= due:
            return  # it fires first and re-arms for the deadline it finds then
        if self._handle is not None:
            self._handle.cancel()  # a shorter limit than the armed one's (the first token's)
        self._at = due
        self._handle = self._loop.call_at(due, self._check)

    def pause(self) -> None:
        self._due = None

    def _check(self) -> None:
        self._handle = None
        due = self._due
        if due is None:
            return  # paused: the next expect() arms it again
        if self._loop.time() >= due:
            self._content.set_exception(TimeoutError("no data within the stall timeout"))
            return
        self._at = due
        self._handle = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _streaming(upstream: aiohttp.ClientResponse, settings: ResumeSettings) -> None:
    """An engine's streamed response, before read_blocks times it: aiohttp's own read
    timeout, which reschedules a timer on every packet that arrives (1.3 µs each, dozens a
    stream), is switched off for it. It stays on until then: it bounds the wait for the
    headers (and for the first piece, where the caller reads one before). The connection's
    next request sets its own again. The connection's receive buffer is capped
    (dataplane/upstream/buffers.py)."""
    connection = upstream.connection
    if connection is not None and connection.protocol is not None:
        connection.protocol.read_timeout = None
        buffers.cap_engine(connection.transport, settings.stream_buffer)


def upstream_blocks(
    upstream: aiohttp.ClientResponse, first: bytes, settings: ResumeSettings
) -> AsyncIterator[bytes]:
    """read_blocks over an engine's streamed response (the first stream's relay)."""
    _streaming(upstream, settings)
    return read_blocks(upstream.content, first, settings, False)


def upstream_events(
    upstream: aiohttp.ClientResponse, first: bytes, settings: ResumeSettings
) -> AsyncIterator[list[Event]]:
    """read_events over an engine's streamed response."""
    _streaming(upstream, settings)
    return read_events(upstream.content, first, settings, False)


async def each_event(
    upstream: aiohttp.ClientResponse, settings: ResumeSettings
) -> AsyncIterator[Event]:
    """upstream_events one event at a time (for resumed streams, where batching buys
    nothing)."""
    async for events in upstream_events(upstream, b"", settings):
        for event in events:
            yield event


async def settle(upstream: aiohttp.ClientResponse) -> None:
    """Gives the connection of a stream whose generation is over back to the pool. A backend
    sends its chunked terminator a packet after [DONE] (and a resume is left at its finish,
    before usage and [DONE]): closing the response there drops the connection, and the next
    request to that backend, a failover's resume above all, pays a TCP connect (5-15 ms
    measured on the failover bench's loaded 2-core fleet). Reads what is left, bounded; at
    EOF aiohttp returns the connection to the pool, otherwise close() drops it."""
    try:
        if not upstream.closed:
            async with asyncio.timeout(TRAILER_SECONDS):
                left = TRAILER_BYTES
                while left > 0 and (chunk := await upstream.content.readany()):
                    left -= len(chunk)
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    finally:
        upstream.close()  # after EOF only marks the response closed


async def post_json(
    session: aiohttp.ClientSession,
    backend: Backend,
    path: str,
    body: dict[str, Any],
    timeouts: Timeouts,
) -> dict[str, Any]:
    """One non-streaming call (`/v1/completions`, `/tokenize`...) and its JSON object
    answer. Raises AttemptFailed: a 5xx is the backend's failure, anything else not a
    JSON object garbage."""
    resp = await open_attempt(session, backend, path, orjson.dumps(body), timeouts)
    try:
        if resp.status != 200:
            raise AttemptFailed(
                Failure.STATUS_5XX if resp.status >= 500 else Failure.GARBAGE,
                f"{path} answered {resp.status}",
            )
        raw = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise classify_exception(exc) from exc
    finally:
        resp.release()
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise AttemptFailed(Failure.GARBAGE, f"{path}: not JSON") from None
    if not isinstance(answer, dict):
        raise AttemptFailed(Failure.GARBAGE, f"{path}: not a JSON object")
    return answer


async def detokenize(
    session: aiohttp.ClientSession, backend: Backend, model: str, ids: list[int], connect: float
) -> str:
    """The engine's own text for `ids` (its tokenizer, not ours: Baton has none). Raises
    AttemptFailed; a 4xx is the backend refusing (resume_failure), not ill health."""
    if not ids:
        return ""
    try:
        async with session.post(
            backend.url + "/detokenize",
            json={"model": model, "tokens": ids},
            headers=backend.call_headers(os.environ),
            timeout=aiohttp.ClientTimeout(total=connect * 2),
        ) as resp:
            if resp.status != 200:
                why = await error_kind(resp, connect)
                raise AttemptFailed(
                    resume_failure(resp.status), f"detokenize answered {resp.status}{why}"
                )
            answer = await resp.json()
        # vLLM answers {"prompt": text}; SGLang's native API {"text": text}.
        text = answer.get("prompt", answer.get("text")) if isinstance(answer, dict) else None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise classify_exception(exc) from exc
    except ValueError:  # not JSON
        raise AttemptFailed(Failure.GARBAGE, "detokenize answered no JSON") from None
    if not isinstance(text, str):
        raise AttemptFailed(Failure.GARBAGE, "detokenize answered no text")
    return text


def _compact(obj: object) -> object:
    if isinstance(obj, array):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON")


def json_body(body: Mapping[str, Any]) -> bytes:
    """A request body as JSON, token-id arrays (array('I'), as a resume's prompt is held)
    included."""
    return orjson.dumps(body, default=_compact)


async def complete_once(
    session: aiohttp.ClientSession, backend: Backend, path: str, body: dict[str, Any], total: float
) -> dict[str, Any] | None:
    """A short non-streaming completion's first choice, or None when the engine did not
    give one (any error: the caller treats the answer as unknown, never as a verdict)."""
    try:
        async with session.post(
            backend.url + path,
            data=json_body(body),
            headers={**JSON_HEADERS, **backend.call_headers(os.environ)},
            timeout=aiohttp.ClientTimeout(total=total),
        ) as resp:
            if resp.status != 200:
                return None
            choice = (orjson.loads(await resp.read()).get("choices") or [{}])[0]
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError, KeyError):
        return None
    return choice if isinstance(choice, dict) else None


def resume_failure(status: int) -> Failure:
    """A 4xx on a resume is the backend refusing this request (a context shorter than the
    prompt plus what was generated, an option it lacks), not a sign of ill health: the
    relay skips that backend without having control demote it. Everything else non-200
    is a failure like any other."""
    failure = classify_status(status)
    if failure is not None:
        return failure
    return Failure.REJECTED if 400 <= status < 500 else Failure.STATUS_5XX


async def error_kind(resp: aiohttp.ClientResponse, timeout: float) -> str:
    """` (type)` from an OpenAI-shaped error body, for events and logs. Only the type: an
    engine's message may quote the request, and events carry no prompt text. Bounded in
    size and time: a refusal must not hold up the failover."""
    try:
        async with asyncio.timeout(timeout):
            raw = await resp.content.read(4096)
    except (aiohttp.ClientError, TimeoutError):
        return ""
    kind = error_type(raw)
    return f" ({kind})" if kind else ""
