"""`python -m bench.floor_proxy --upstream URL ...`: the floor a Python router stands on.

A bare aiohttp + uvloop reverse proxy: round robin over the upstreams, the request body
forwarded as bytes, the response relayed chunk by chunk as it comes, no parsing, no RPC, no
metrics. No router built on this stack can cost less per request, so bench.overhead states
Baton's cost against this one's. Prints `FLOOR READY http://HOST:PORT` once bound.

With `--decider HOST:PORT` (bench/floor_decider.py) it asks that process which upstream to
use, once per request, over one TCP connection in baton/frames.py's framing: the floor of a
router whose decisions are made by one process for all its proxies, as Baton's control makes
them for its shims.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools

import aiohttp
import uvloop
from aiohttp import web

from baton.frames import HEADER, Deframer

# Hop-by-hop and framing headers: aiohttp sets its own for each side.
DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class _Decider(asyncio.Protocol):
    """One connection to bench.floor_decider; answers come in the order asked."""

    def __init__(self) -> None:
        self._frames = Deframer()
        self._waiting: collections.deque[asyncio.Future[int]] = collections.deque()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for body in self._frames.feed(data):
            self._waiting.popleft().set_result(body[0])

    def connection_lost(self, exc: Exception | None) -> None:
        while self._waiting:
            self._waiting.popleft().set_exception(ConnectionError("decider gone"))

    def ask(self, question: bytes) -> asyncio.Future[int]:
        assert self._transport is not None
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.append(answer)
        self._transport.write(HEADER.pack(len(question)) + question)
        return answer


async def serve(host: str, port: int, upstreams: list[str], decider: str = "") -> None:
    ring = itertools.cycle(upstreams)
    asker: _Decider | None = None
    if decider:
        d_host, _, d_port = decider.rpartition(":")
        _, asker = await asyncio.get_running_loop().create_connection(
            _Decider, d_host, int(d_port)
        )
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
    )

    async def relay(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
        body = await request.read()
        if asker is None:
            base = next(ring)
        else:
            base = upstreams[await asker.ask(request.path.encode() + b" %d" % len(body))]
        async with session.request(
            request.method, base + request.path_qs, data=body, headers=headers
        ) as upstream:
            resp = web.StreamResponse(status=upstream.status)
            resp.content_type = upstream.content_type
            if upstream.content_length is not None:
                resp.content_length = upstream.content_length
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", relay)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024).start()
    print(f"FLOOR READY http://{host}:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()  # until SIGTERM ends the process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor_proxy", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free one)")
    p.add_argument("--upstream", action="append", required=True, help="base URL, repeatable")
    p.add_argument("--decider", default="", help="HOST:PORT of a bench.floor_decider to ask")
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    uvloop.run(serve(host, int(port), [u.rstrip("/") for u in args.upstream], args.decider))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
