"""A client that stops reading a stream: how long the shim waits for it.

The shim writes a stream no faster than its client reads it: aiohttp's write waits while
the socket's buffers are full, the relay does not read the engine meanwhile, and the
engine's own writes then block (the backpressure a bare proxy gives). What a stalled
client still costs is the engine's: vLLM goes on generating that request to its end
(max_tokens), holding its KV blocks, and keeps the unsent output; only closing the
connection aborts it. So a write that has waited `timeout` seconds ends the stream: the
client's connection is aborted, which the relay sees as a client that went away (the
upstream is closed and vLLM aborts the request). nginx's `send_timeout` (60 s) is the same
rule.

One timer per stream, armed at the first write that waits and re-armed only when it comes
due: a write costs two attribute stores, not a timer."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from prometheus_client import Counter

log = logging.getLogger(__name__)


class GuardedStream:
    """The client's stream response, with a deadline on each write (the relay's
    ClientStream)."""

    __slots__ = ("_resp", "_request", "_timeout", "_stalls", "_loop", "_since", "_handle", "ended")

    def __init__(
        self, request: web.Request, resp: web.StreamResponse, timeout: float, stalls: Counter
    ) -> None:
        """`timeout`: seconds a write may wait for the client (0 = forever); `stalls`:
        counts the streams ended for it."""
        self._request = request
        self._resp = resp
        self._timeout = timeout
        self._stalls = stalls
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the pending write began; None: none pending
        self._handle: asyncio.TimerHandle | None = None
        self.ended = False  # this guard aborted the client's connection

    async def write(self, data: bytes) -> None:
        if self._timeout <= 0:
            await self._resp.write(data)
            return
        self._since = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self._since + self._timeout, self._check)
        try:
            await self._resp.write(data)
        finally:
            self._since = None

    def _check(self) -> None:
        self._handle = None
        since = self._since
        if since is None:
            return  # nothing waiting: the next write arms it again
        due = since + self._timeout
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self.ended = True
        self._stalls.inc()
        log.warning("a client read nothing of its stream for %.0f s: ending it", self._timeout)
        transport = self._request.transport
        if transport is not None:
            # The pending write returns, and the relay's next one raises as for a client that
            # went away: the upstream is closed, and vLLM aborts the request.
            transport.abort()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
