"""The shim's outbox: reports to control wait (bounded) while control is away, go in order
when it is back, and a permanent refusal is dropped rather than retried forever."""

from __future__ import annotations

import asyncio

import grpc

from dataplane.link.outbox import Outbox, Report


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "test")


class FakeControl:
    """Answers reports while `reachable`; records what it took, in order."""

    def __init__(self) -> None:
        self.reachable = False
        self.taken: list[int] = []

    def report(self, n: int, kind: str = "failover") -> Report:
        async def send() -> None:
            if n < 0:
                raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT)
            if not self.reachable:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE)
            self.taken.append(n)

        return Report(kind, send)


def test_buffered_while_away_bounded_then_delivered_in_order() -> None:
    async def scenario() -> None:
        control = FakeControl()
        up = asyncio.Event()
        up.set()
        outages: list[str] = []
        away = asyncio.Event()

        def unreachable(why: str) -> None:
            outages.append(why)
            up.clear()
            away.set()

        box = Outbox(5, up=up, on_unreachable=unreachable)
        for n in range(7):  # two past the bound
            box.put(control.report(n, "failover" if n % 2 else "attempt_failure"))
        await asyncio.wait_for(away.wait(), 5)  # the sender tried the first report
        assert len(outages) == 1 and not up.is_set()  # the first failure says "away"
        assert len(box) == 5 and control.taken == []
        assert box.dropped == {"failover": 1, "attempt_failure": 1}  # n = 5, 6
        control.reachable = True
        up.set()  # what ControlLink's probe does when control answers again
        await box.close(grace=2.0)
        assert control.taken == [0, 1, 2, 3, 4] and len(box) == 0 and box.delivered == 5

    asyncio.run(scenario())


def test_a_permanent_refusal_is_dropped_not_retried() -> None:
    async def scenario() -> None:
        control = FakeControl()
        control.reachable = True
        up = asyncio.Event()
        up.set()
        box = Outbox(10, up=up, on_unreachable=lambda why: up.clear())
        for n in (1, -1, 2):
            box.put(control.report(n))
        await box.close(grace=2.0)
        assert control.taken == [1, 2] and box.rejected == 1 and up.is_set()

    asyncio.run(scenario())
