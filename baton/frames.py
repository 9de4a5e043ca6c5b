"""Length-prefixed frames for control's route socket (proto/baton/v1/routing.proto,
RouteSocketHello): each frame is a 4-byte big-endian length, then that many bytes of one
protobuf message. Shared by both ends; pure bytes in, bytes out."""

# baton: pure

from __future__ import annotations

import struct

from google.protobuf.message import Message

HEADER = struct.Struct(">I")
# A frame carries one batch of routes or outcomes (a few KiB under load): a peer announcing
# more is broken or hostile, and is cut off before its bytes are buffered.
MAX_FRAME = 16 << 20
# Before the hello is accepted, only a hello may arrive: a token's worth of bytes.
MAX_HELLO = 4 << 10


class FrameError(ValueError):
    """The peer sent something that is not a frame of this protocol."""


def frame(message: Message) -> bytes:
    body = message.SerializeToString()
    return HEADER.pack(len(body)) + body


class Deframer:
    """Bytes as they arrive in, whole frames' bodies out. `limit` bounds one frame; it may be
    lowered (a hello's) and raised again (after it)."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        start = 0
        size = HEADER.size
        while len(buf) - start >= size:
            (length,) = HEADER.unpack_from(buf, start)
            if length > self.limit:
                raise FrameError(f"a frame of {length} bytes (at most {self.limit})")
            end = start + size + length
            if len(buf) < end:
                break
            out.append(bytes(buf[start + size : end]))
            start = end
        if start:
            del buf[:start]
        return out
