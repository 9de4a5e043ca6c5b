"""A real HTTP hop in front of an engine that cuts one chosen stream after k tokens: tests arm
it per request, so one fleet can fail a stream at every position in turn. In front of a sim
the cut is the sim's own (`X-Sim-Fault: die-after=k` added to the armed request; the sim
drops the connection mid-stream without [DONE]), and the proxy drops its client connection
when that happens. In front of a real engine (`count_ids`) the proxy counts the token ids of
the events it relays and drops the connection after the event that brings them to k: to the
shim that is the engine dying there (the engine itself goes on; nothing of it is used)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import orjson
from aiohttp import web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


class Arm:
    """The next cut, shared by the proxies of one fleet: whichever gets the next generation
    request cuts it, and only that one (the resume and the seam check pass)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._k: int | None = None
        self._garble = False
        self.fired = threading.Event()

    def garble_next_resume(self) -> None:
        """The next resume (a prompt of token ids) gets other text in its first text chunk:
        an engine whose text does not match its ids, which the seam check must catch."""
        with self._lock:
            self._garble = True

    def take_garble(self) -> bool:
        with self._lock:
            garble, self._garble = self._garble, False
        return garble

    def set(self, k: int) -> None:
        with self._lock:
            self._k = k
            self.fired.clear()

    def take(self) -> int | None:
        with self._lock:
            k, self._k = self._k, None
        if k is not None:
            self.fired.set()
        return k


async def _serve(
    target: str, arm: Arm, ready: asyncio.Future[str], count_ids: bool = False
) -> None:
    session = aiohttp.ClientSession(auto_decompress=False)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        # A generation the tests stream, not the shim's one-token question of what an engine
        # shows for a think tag (dataplane/relay/resume/markers.py: allowed_token_ids).
        generation = request.path.endswith("/completions") and body and not _is_probe(body)
        k = arm.take() if generation else None
        if k is not None and not count_ids:
            headers["X-Sim-Fault"] = f"die-after={k}"
        garble = k is None and _is_resume(body) and arm.take_garble()
        async with session.request(
            request.method, target + request.path_qs, data=body, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status)
            for name in ("Content-Type", "Cache-Control"):
                if name in up.headers:
                    resp.headers[name] = up.headers[name]
            await resp.prepare(request)
            try:
                if garble:
                    await _relay_garbled(up, resp)
                    await resp.write_eof()
                    return resp
                if k is not None and count_ids:
                    await _relay_until(up, resp, k)
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                async for piece in up.content.iter_any():
                    await resp.write(piece)
            except aiohttp.ClientPayloadError:
                # The sim cut the stream: so does this hop (no chunked terminator).
                if request.transport is not None:
                    request.transport.abort()
                return resp
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    ready.set_result(f"http://127.0.0.1:{port}")
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        await runner.cleanup()


def _is_probe(body: bytes) -> bool:
    try:
        return "allowed_token_ids" in orjson.loads(body)
    except (orjson.JSONDecodeError, TypeError):
        return False


def _is_resume(body: bytes) -> bool:
    try:
        prompt = orjson.loads(body).get("prompt")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


async def _relay_until(up: aiohttp.ClientResponse, resp: web.StreamResponse, k: int) -> None:
    """Relay SSE events until the one that brings the token ids relayed to k or more."""
    seen = 0
    async for line in up.content:
        await resp.write(line)
        if line.startswith(b"data: {"):
            for ch in orjson.loads(line[6:]).get("choices") or ():
                seen += len(ch.get("token_ids") or ())
        elif line.strip() == b"" and seen >= k:
            return  # the event is whole: the engine "dies" right after it


async def _relay_garbled(up: aiohttp.ClientResponse, resp: web.StreamResponse) -> None:
    """Relay SSE events, with "X" put in front of the first event's text that has any."""
    done = False
    async for line in up.content:
        if not done and line.startswith(b"data: {"):
            event = orjson.loads(line[6:])
            for ch in event.get("choices") or ():
                if ch.get("text"):
                    ch["text"] = "X" + ch["text"]
                    done = True
            line = b"data: " + orjson.dumps(event) + b"\n"
        await resp.write(line)


@contextmanager
def cut_proxies(targets: list[str], arm: Arm, count_ids: bool = False) -> Iterator[list[str]]:
    """One proxy per target URL, on their own event loop thread; yields their URLs.
    `count_ids`: the targets are real engines (the proxy counts ids and cuts itself)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    urls, serving = [], []  # the futures keep the proxies' tasks referenced (alive)
    try:
        for t in targets:
            ready: asyncio.Future[str] = loop.create_future()
            serving.append(asyncio.run_coroutine_threadsafe(_serve(t, arm, ready, count_ids), loop))
            urls.append(asyncio.run_coroutine_threadsafe(_wait(ready), loop).result(10))
        yield urls
    finally:
        asyncio.run_coroutine_threadsafe(_stop_all(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


async def _wait(f: asyncio.Future[str]) -> str:
    return await f


async def _stop_all() -> None:
    """Cancel the proxies and wait for their clean-up (runner, client session)."""
    me = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not me]
    for t in others:
        t.cancel()
    await asyncio.gather(*others, return_exceptions=True)
