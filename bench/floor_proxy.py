"""`python -m bench.floor_proxy --upstream URL ...`: the floor a Python router stands on.

A bare aiohttp + uvloop reverse proxy: round robin over the upstreams, the request body
forwarded as bytes, the response relayed chunk by chunk as it comes, no parsing, no RPC, no
metrics. No router built on this stack can cost less per request, so bench.overhead states
Baton's cost against this one's. Prints `FLOOR READY http://HOST:PORT` once bound.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import aiohttp
import uvloop
from aiohttp import web

# Hop-by-hop and framing headers: aiohttp sets its own for each side.
DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection"})


async def serve(host: str, port: int, upstreams: list[str]) -> None:
    ring = itertools.cycle(upstreams)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
    )

    async def relay(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
        async with session.request(
            request.method, next(ring) + request.path_qs, data=await request.read(),
            headers=headers,
        ) as upstream:  # fmt: skip
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
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    uvloop.run(serve(host, int(port), [u.rstrip("/") for u in args.upstream]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
