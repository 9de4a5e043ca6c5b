"""The shim's RouteStream over real gRPC (an in-process server on 127.0.0.1): one request can
have two questions in flight (a failover's report to control made late, then that request's
next failover), and each gets an answer; neither waits forever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from baton.v1 import fleet_pb2, routing_pb2, routing_pb2_grpc
from dataplane.link.routestream import RouteStream

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
