"""GuardedStream (dataplane/edge/clientwrite.py): a write that waits longer than the limit
for its client aborts the client's connection once; writes that go through never do."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from dataplane.edge.clientwrite import GuardedStream


class Transport:
    def __init__(self) -> None:
        self.aborted = asyncio.Event()

    def abort(self) -> None:
        self.aborted.set()


class Resp:
    """A stream response whose writes wait until `reading` is set (a client's pace)."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()
        self.reading.set()
        self.out: list[bytes] = []

    async def write(self, data: bytes) -> None:
        await self.reading.wait()
        self.out.append(data)


class Request:
    def __init__(self) -> None:
        self.transport = Transport()


def guarded(timeout: float) -> tuple[GuardedStream, Resp, Request, Counter]:
    resp, request = Resp(), Request()
    stalls = Counter("stalls", "", registry=CollectorRegistry())
    guard = GuardedStream(request, resp, timeout, stalls)  # type: ignore[arg-type]
    return guard, resp, request, stalls


def count(c: Counter) -> float:
    value: Any = c._value.get()  # noqa: SLF001
    return float(value)


def test_a_write_the_client_never_takes_aborts_its_connection_once() -> None:
    async def run() -> None:
        guard, resp, request, stalls = guarded(0.05)
        await guard.write(b"a")
        resp.reading.clear()  # the client stops reading
        pending = asyncio.ensure_future(guard.write(b"b"))
        await asyncio.wait_for(request.transport.aborted.wait(), 5)
        assert guard.ended and count(stalls) == 1 and resp.out == [b"a"]
        resp.reading.set()  # (aborting the transport ends the wait, as aiohttp's does)
        await pending
        guard.close()

    asyncio.run(run())


def test_writes_that_go_through_never_abort() -> None:
    async def run() -> None:
        guard, resp, request, stalls = guarded(0.05)
        for i in range(20):
            await guard.write(b"%d" % i)
            await asyncio.sleep(0.01)  # longer, in all, than the limit: only a wait counts
        guard.close()
        assert not request.transport.aborted.is_set() and count(stalls) == 0
        assert len(resp.out) == 20

    asyncio.run(run())


def test_no_limit_waits_forever() -> None:
    async def run() -> None:
        guard, resp, request, _ = guarded(0)
        resp.reading.clear()
        pending = asyncio.ensure_future(guard.write(b"x"))
        await asyncio.sleep(0.1)
        assert not pending.done() and not request.transport.aborted.is_set()
        resp.reading.set()
        await pending

    asyncio.run(run())
