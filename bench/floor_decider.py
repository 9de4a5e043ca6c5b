"""`python -m bench.floor_decider`: the least a central router decision can be, for
bench.floor_proxy's `--decider`.

One process that answers each length-prefixed frame (baton/frames.py's framing) with the
index of the upstream to use, round robin, inside data_received: no parsing beyond the
framing, no state but a counter. A floor proxy that asks it once per request costs what one
round trip to a decision process costs on this stack, and nothing Baton's decision adds (the
policy, pins, load, the audit row). Prints `DECIDER READY HOST:PORT` once bound.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import uvloop

from baton.frames import HEADER, Deframer


class _Asker(asyncio.Protocol):
    def __init__(self, upstreams: int) -> None:
        self._ring = itertools.cycle(range(upstreams))
        self._frames = Deframer()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        answers = [HEADER.pack(1) + bytes((next(self._ring),)) for _ in self._frames.feed(data)]
        self._transport.write(b"".join(answers))


async def serve(host: str, port: int, upstreams: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Asker(upstreams), host, port)
    bound = server.sockets[0].getsockname()
    print(f"DECIDER READY {bound[0]}:{bound[1]}", flush=True)
    await asyncio.Event().wait()  # until SIGTERM ends the process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor_decider", description=__doc__)
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free one)")
    p.add_argument("--upstreams", type=int, required=True, help="how many to choose from")
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    uvloop.run(serve(host, int(port), args.upstreams))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
