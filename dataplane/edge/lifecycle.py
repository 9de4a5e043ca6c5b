"""A shim's graceful stop (SIGTERM): stop accepting, let the requests in flight finish within
a deadline, and end whatever is still running at the deadline explicitly: a stream gets an
OpenAI-shaped SSE error event and `[DONE]` (never a silent truncation), a request that has
not started its answer gets a 503.

The middleware runs in each request's own task (aiohttp creates one per request), so ending
a request is cancelling that task: the proxy's cleanup runs as for a client that went away
(the upstream request is closed, which frees the engine), and the middleware, seeing its own
cancellation, writes the ending and returns the response normally."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from dataplane.exceptions import ErrorKind, OpenAIError

log = logging.getLogger("baton.shim.lifecycle")

STREAM = "baton.stream_response"  # request-scoped: the SSE response once it is prepared
SHUTDOWN_MESSAGE = "the shim is shutting down and this request did not finish within its grace"


class InFlight:
    """The request tasks of one shim process."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self._ending: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._tasks)

    def enter(self, task: asyncio.Task[object]) -> None:
        self._tasks.add(task)
        self._idle.clear()

    def leave(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        self._ending.discard(task)
        if not self._tasks:
            self._idle.set()

    def ended_by_us(self, task: asyncio.Task[object]) -> bool:
        return task in self._ending

    async def wait_idle(self, timeout: float, hurry: asyncio.Event | None = None) -> bool:
        """True when every request finished within `timeout` (or before `hurry` was set)."""
        waiters = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waiters.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return self._idle.is_set()

    async def end_all(self, timeout: float = 5.0) -> int:
        """Cancel every request still in flight; each ends with an explicit error (see
        `graceful`). Returns how many were ended."""
        tasks = list(self._tasks)
        for task in tasks:
            self._ending.add(task)
            task.cancel()
        if tasks:
            await self.wait_idle(timeout)
        return len(tasks)


INFLIGHT = web.AppKey("inflight", InFlight)
# A second stop signal cuts the grace short only this long after the first: one SIGTERM was
# seen to reach the shim's handler twice, 1 ms apart, under load (what sent the second is not
# pinned down), and ended a stream that had 30 s of grace. An operator's second Ctrl-C comes
# later than this.
REPEAT_S = 1.0


class Stopping:
    """The shim's stop signals: the first starts the graceful stop (`stop`); another one at
    least REPEAT_S later cuts its grace short (`hurry`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self._clock = clock
        self._first = 0.0

    def signalled(self) -> None:
        now = self._clock()
        if not self.stop.is_set():
            self._first = now
            self.stop.set()
        elif now - self._first >= REPEAT_S:
            self.hurry.set()
        else:
            log.info("a stop signal again, %.3f s after the first: no hurry", now - self._first)


@web.middleware
async def graceful(request: web.Request, handler: Handler) -> web.StreamResponse:
    inflight = request.app[INFLIGHT]
    task = asyncio.current_task()
    if task is None:  # not reachable under aiohttp; keeps the types honest
        return await handler(request)
    inflight.enter(task)
    try:
        return await handler(request)
    except asyncio.CancelledError:
        if not inflight.ended_by_us(task):
            raise  # the client went away: nothing to tell it
        task.uncancel()
        return await _ending(request)
    finally:
        inflight.leave(task)


async def _ending(request: web.Request) -> web.StreamResponse:
    err = OpenAIError(ErrorKind.SHUTTING_DOWN, SHUTDOWN_MESSAGE)
    resp: web.StreamResponse | None = request.get(STREAM)
    if resp is None:
        status, body = err.for_path(request.path)
        return web.Response(body=body, status=status, content_type="application/json")
    with contextlib.suppress(ConnectionError):
        await resp.write(err.stream_end(request.path))
        await resp.write_eof()
    return resp


async def remember_stream(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an SSE response, once its headers go out, is what an ending at
    the deadline must be written to."""
    if response.content_type == "text/event-stream":
        request[STREAM] = response


def install(app: web.Application) -> None:
    app[INFLIGHT] = InFlight()
    app.on_response_prepare.append(remember_stream)
