"""The shim's RouteStream over real gRPC (an in-process server on 127.0.0.1): one request can
have two questions in flight (a failover's report to control made late, then that request's
next failover), and each gets an answer; neither waits forever. Its messages move to control's
route socket once told its port, a question asked on gRPC before still gets its answer, and a
socket that can't be reached or refuses the token leaves them on gRPC."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import pytest

from baton.v1 import fleet_pb2, routing_pb2, routing_pb2_grpc
from control.api.route_socket import RouteSocket
from dataplane.exceptions import StreamBroken
from dataplane.link import routestream
from dataplane.link.routestream import RouteStream

T = TypeVar("T")

pytestmark = pytest.mark.timeout(30)


class SlowControl(routing_pb2_grpc.RoutingServiceServicer):
    """Answers failovers only once two have arrived, which keeps both questions in flight
    together, with the backend `after-<failed backend>`, in the order asked."""

    def __init__(self) -> None:
        self.asked = 0
        self.first_asked = asyncio.Event()
        self.both_asked = asyncio.Event()

    async def RouteStream(
        self, request_iterator: AsyncIterator[routing_pb2.RouteStreamRequest], context: Any
    ) -> AsyncIterator[routing_pb2.RouteStreamResponse]:
        inbox: asyncio.Queue[routing_pb2.RouteStreamRequest | None] = asyncio.Queue()

        async def read() -> None:  # reads on while answers are held
            async for msg in request_iterator:
                self.asked += len(msg.failovers)
                if self.asked >= 1:
                    self.first_asked.set()
                if self.asked >= 2:
                    self.both_asked.set()
                inbox.put_nowait(msg)
            inbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (msg := await inbox.get()) is not None:
                await self.both_asked.wait()
                yield routing_pb2.RouteStreamResponse(
                    results=[
                        routing_pb2.RouteResult(
                            request_id=f.request_id,
                            response=routing_pb2.RouteResponse(
                                backends=[fleet_pb2.Backend(id=f"after-{f.failed_backend_id}")]
                            ),
                        )
                        for f in msg.failovers
                    ]
                )
        finally:
            reader.cancel()


async def two_questions_for_one_request() -> list[str]:
    server = grpc.aio.server()
    control = SlowControl()
    routing_pb2_grpc.add_RoutingServiceServicer_to_server(control, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = RouteStream(
                routing_pb2_grpc.RoutingServiceStub(channel), max_outcomes=10, timeout=5.0
            )
            try:
                ask = routing_pb2.FailoverRequest
                first = asyncio.create_task(
                    stream.failover(ask(request_id="r", failed_backend_id="a"))
                )
                await asyncio.wait_for(control.first_asked.wait(), 3.0)  # it is on its way
                second = stream.failover(ask(request_id="r", failed_backend_id="b"))
                answers = await asyncio.wait_for(asyncio.gather(first, second), 3.0)
            finally:
                await stream.close()
    finally:
        await server.stop(None)
    return [a.backends[0].id for a in answers]


def test_two_questions_in_flight_for_one_request_both_get_their_answer() -> None:
    assert asyncio.run(two_questions_for_one_request()) == ["after-a", "after-b"]


# -- the route socket: RouteStream's messages without gRPC ---------------------------------


class EchoControl(routing_pb2_grpc.RoutingServiceServicer):
    """Answers each route with the backend named after how it was asked (`grpc` or `socket`),
    and counts outcomes by way; `hold` keeps gRPC answers back until set."""

    def __init__(self) -> None:
        self.outcomes = {"grpc": 0, "socket": 0}
        self.hold = asyncio.Event()
        self.hold.set()
        self.asked = {"grpc": asyncio.Event(), "socket": asyncio.Event()}
        self.reported = {"grpc": asyncio.Event(), "socket": asyncio.Event()}

    def answer(
        self, msg: routing_pb2.RouteStreamRequest, way: str
    ) -> routing_pb2.RouteStreamResponse | None:
        if any(r.request_id == "boom" for r in msg.routes):
            raise RuntimeError("a decision that raised")
        self.outcomes[way] += len(msg.outcomes)
        if msg.outcomes:
            self.reported[way].set()
        results = [
            routing_pb2.RouteResult(
                request_id=r.request_id,
                response=routing_pb2.RouteResponse(backends=[fleet_pb2.Backend(id=way)]),
            )
            for r in msg.routes
        ]
        return routing_pb2.RouteStreamResponse(results=results) if results else None

    async def RouteStream(
        self, request_iterator: AsyncIterator[routing_pb2.RouteStreamRequest], context: Any
    ) -> AsyncIterator[routing_pb2.RouteStreamResponse]:
        async for msg in request_iterator:
            self.asked["grpc"].set()
            await self.hold.wait()
            answer = self.answer(msg, "grpc")
            if answer is not None:
                yield answer


async def with_control(
    test: Callable[[RouteStream, EchoControl, int], Awaitable[T]], *, token: str | None = None
) -> T:
    """`test(stream, control, socket port)` against an in-process gRPC RouteStream and a real
    route socket (control/api/route_socket.py) on 127.0.0.1."""
    server = grpc.aio.server()
    control = EchoControl()
    routing_pb2_grpc.add_RoutingServiceServicer_to_server(control, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sock = RouteSocket(lambda msg, later: control.answer(msg, "socket"), token)
    socket_port = await sock.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = RouteStream(
                routing_pb2_grpc.RoutingServiceStub(channel),
                max_outcomes=10,
                timeout=5.0,
                metadata=(("authorization", "Bearer shim-token"),),
            )
            try:
                return await test(stream, control, socket_port)
            finally:
                await stream.close()
    finally:
        await sock.stop()
        await server.stop(None)


async def route(stream: RouteStream, request_id: str) -> str:
    answer = await asyncio.wait_for(
        stream.route(routing_pb2.RouteRequest(request_id=request_id)), 3.0
    )
    return answer.backends[0].id


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_routes_ride_the_route_socket_once_control_tells_it() -> None:
    async def test(stream: RouteStream, control: EchoControl, port: int) -> list[object]:
        before = await route(stream, "r1")  # no port told yet: gRPC
        stream.use_socket(("127.0.0.1", port))
        after = [await route(stream, "r2"), stream.over_socket]
        stream.report(routing_pb2.RequestOutcome(request_id="r2"))
        stream.flush()
        await asyncio.wait_for(control.reported["socket"].wait(), 3.0)
        assert control.outcomes == {"grpc": 0, "socket": 1}
        return [before, *after]

    assert asyncio.run(with_control(test)) == ["grpc", "socket", True]


def test_a_question_in_flight_on_grpc_is_answered_after_the_switch_to_the_socket() -> None:
    async def test(stream: RouteStream, control: EchoControl, port: int) -> list[str]:
        control.hold.clear()
        first = asyncio.create_task(route(stream, "r1"))  # asked over gRPC, held there
        await asyncio.wait_for(control.asked["grpc"].wait(), 3.0)
        stream.use_socket(("127.0.0.1", port))
        second = await route(stream, "r2")  # the switch: over the socket at once
        control.hold.set()
        return [await first, second]

    assert asyncio.run(with_control(test)) == ["grpc", "socket"]


def test_a_route_socket_that_cannot_be_reached_leaves_routes_on_grpc() -> None:
    async def test(stream: RouteStream, control: EchoControl, port: int) -> list[object]:
        stream.use_socket(("127.0.0.1", free_port()))  # nothing listens there
        return [await route(stream, "r1"), await route(stream, "r2"), stream.over_socket]

    assert asyncio.run(with_control(test)) == ["grpc", "grpc", False]


def test_a_route_socket_that_refuses_the_token_leaves_routes_on_grpc() -> None:
    async def test(stream: RouteStream, control: EchoControl, port: int) -> list[object]:
        stream.use_socket(("127.0.0.1", port))
        return [await route(stream, "r1"), stream.over_socket, control.outcomes]

    got = asyncio.run(with_control(test, token="another-token"))
    assert got == ["grpc", False, {"grpc": 0, "socket": 0}]


def test_a_decision_that_raises_fails_its_socket_not_control() -> None:
    """Control cuts that shim's socket (its questions fail at once: the shim routes from its
    snapshot), logs the error, and answers the next connection."""

    async def test(stream: RouteStream, control: EchoControl, port: int) -> list[object]:
        stream.use_socket(("127.0.0.1", port))
        first = await route(stream, "r1")
        with pytest.raises(StreamBroken):
            await route(stream, "boom")
        return [first, await route(stream, "r2"), stream.over_socket]

    assert asyncio.run(with_control(test)) == ["socket", "socket", True]


def test_a_peer_that_never_says_hello_is_cut_off() -> None:
    async def test() -> bytes:
        sock = RouteSocket(lambda msg, later: None, "shim-token", hello_within=0.2)
        port = await sock.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(reader.read(), 10.0)  # b"" once closed
            finally:
                writer.close()
        finally:
            await sock.stop()

    assert asyncio.run(test()) == b""


def test_a_route_socket_that_failed_is_tried_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not left on gRPC for good: control's socket down at the first try (a late welcome on a
    loaded machine is the same), up again, and the next route after the retry interval rides
    it."""
    monkeypatch.setattr(routestream, "SOCKET_RETRY_S", 0.3)

    async def test(stream: RouteStream, control: EchoControl, port: int) -> list[object]:
        down = RouteSocket(lambda msg, later: control.answer(msg, "socket"), "shim-token")
        spare = await down.start("127.0.0.1", 0)
        await down.stop()  # nothing listens there now
        stream.use_socket(("127.0.0.1", spare))
        first = await route(stream, "r1")
        up = RouteSocket(lambda msg, later: control.answer(msg, "socket"), "shim-token")
        await up.start("127.0.0.1", spare)
        try:
            soon = await route(stream, "r2")  # within the interval: still gRPC
            await asyncio.sleep(0.4)  # the retry interval itself is what is tested
            return [first, soon, await route(stream, "r3"), stream.over_socket]
        finally:
            await stream.close()
            await up.stop()

    assert asyncio.run(with_control(test, token="shim-token")) == ["grpc", "grpc", "socket", True]
