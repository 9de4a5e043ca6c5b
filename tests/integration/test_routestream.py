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
from dataplane.routestream import RouteStream

pytestmark = pytest.mark.timeout(30)


class SlowControl(routing_pb2_grpc.RoutingServiceServicer):
    """Answers each failover, after a delay that keeps questions in flight together, with
    the backend `after-<failed backend>`, in the order asked."""

    async def RouteStream(
        self, request_iterator: AsyncIterator[routing_pb2.RouteStreamRequest], context: Any
    ) -> AsyncIterator[routing_pb2.RouteStreamResponse]:
        async for msg in request_iterator:
            await asyncio.sleep(0.05)
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


async def two_questions_for_one_request() -> list[str]:
    server = grpc.aio.server()
    routing_pb2_grpc.add_RoutingServiceServicer_to_server(SlowControl(), server)
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
                await asyncio.sleep(0.01)  # the first is on its way
                second = stream.failover(ask(request_id="r", failed_backend_id="b"))
                answers = await asyncio.wait_for(asyncio.gather(first, second), 3.0)
            finally:
                await stream.close()
    finally:
        await server.stop(None)
    return [a.backends[0].id for a in answers]


def test_two_questions_in_flight_for_one_request_both_get_their_answer() -> None:
    assert asyncio.run(two_questions_for_one_request()) == ["after-a", "after-b"]
