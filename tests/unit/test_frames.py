"""The route socket's frames: whatever way the bytes are cut on the wire, the same messages
come out, in order; a frame longer than the limit is refused before its bytes are kept."""

from __future__ import annotations

import pytest

from baton.frames import HEADER, Deframer, FrameError, frame
from baton.v1 import routing_pb2


def messages() -> list[routing_pb2.RouteStreamRequest]:
    return [
        routing_pb2.RouteStreamRequest(
            routes=[routing_pb2.RouteRequest(request_id=f"r{i}", traceparent="é" * i)]
        )
        for i in range(5)
    ] + [routing_pb2.RouteStreamRequest()]  # an empty message is a frame of 0 bytes


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 64, 1 << 20])
def test_messages_survive_any_cut_of_the_bytes(cut: int) -> None:
    wire = b"".join(frame(m) for m in messages())
    deframer = Deframer()
    bodies: list[bytes] = []
    for i in range(0, len(wire), cut):
        bodies += deframer.feed(wire[i : i + cut])
    assert [routing_pb2.RouteStreamRequest.FromString(b) for b in bodies] == messages()


def test_a_frame_over_the_limit_is_refused_from_its_header() -> None:
    deframer = Deframer(limit=16)
    with pytest.raises(FrameError, match="17 bytes"):
        deframer.feed(HEADER.pack(17))  # refused before any of its body arrives
    assert Deframer(limit=16).feed(HEADER.pack(16) + b"x" * 16) == [b"x" * 16]


def test_the_limit_can_be_raised_after_a_hello() -> None:
    deframer = Deframer(limit=8)
    hello = frame(routing_pb2.RouteSocketHello(authorization="Bear"))
    assert len(deframer.feed(hello)) == 1
    deframer.limit = 1 << 20
    big = frame(
        routing_pb2.RouteStreamRequest(routes=[routing_pb2.RouteRequest(request_id="x" * 100)])
    )
    assert len(deframer.feed(big)) == 1
