"""Pure SSE framing, both ways: split a byte stream into events, keeping each event's raw
bytes so the relay can forward them untouched (no re-serialisation on the hot path), and
frame an object or the end of a stream for the client. Reading an engine's stream off the
network is dataplane/upstream/engine.py's."""

# baton: pure

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import orjson

DONE = b"[DONE]"  # the data of the last event
DONE_EVENT = b"data: " + DONE + b"\n\n"  # the last event, framed


class ClientStream(Protocol):
    """Where a relay writes the client's stream: the response itself, or a writer that
    turns it into another format on the way (responses/translate.py)."""

    async def write(self, data: bytes) -> None: ...


def sse(obj: Any) -> bytes:
    """One data event carrying `obj` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Event(NamedTuple):
    # A tuple, not a frozen dataclass: one is built per token, and a frozen dataclass's
    # __init__ sets each field through object.__setattr__.
    raw: bytes  # the whole event including its terminating blank line
    data: bytes  # the joined `data:` field(s); b"" for comment/keep-alive events

    @property
    def is_done(self) -> bool:
        return self.data == DONE


# Event's own __new__ is a Python lambda around this: one is built per token.
_event = tuple.__new__


def _data_of(block: bytes) -> bytes:
    if block.startswith(b"data: ") and b"\n" not in block:
        return block[6:]  # the one-line event every engine sends: skip the line split
    parts = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts)


class SSEParser:
    """Incremental: feed() bytes as they arrive, get the complete events so far.
    Accepts \\n, \\r\\n and \\r line endings (normalised to \\n); a partial event stays
    buffered until completed. The events do not depend on how the stream was cut into reads."""

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._buf = b""
        self._max = max_event_bytes
        self._after_cr = False  # the last chunk ended in \\r: a leading \\n ends the same line

    def feed(self, chunk: bytes) -> list[Event]:
        if not chunk:
            return []
        if (
            not self._buf
            and not self._after_cr
            and chunk.endswith(b"\n\n")
            and chunk.find(b"\n\n") == len(chunk) - 2
            and b"\r" not in chunk
            and len(chunk) - 2 <= self._max
        ):
            # One whole event in one read, what an engine sends a token at a time (no \r,
            # so the line endings need no normalising): no buffer joined or kept.
            return [_event(Event, (chunk, _data_of(chunk[:-2])))]
        # Each chunk is normalised once, before joining the buffer: normalising the joined
        # buffer again would turn "\\r\\r\\n" into a different event depending on the cut.
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf + chunk
        events = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            if end - start > self._max:  # however it arrived: the same limit for every cut
                raise ValueError(f"SSE event larger than {self._max} bytes")
            events.append(_event(Event, (buf[start : end + 2], _data_of(buf[start:end]))))
            start = end + 2
        self._buf = buf[start:]
        if len(self._buf) - self._buf.endswith(b"\n") > self._max:
            raise ValueError(f"SSE event larger than {self._max} bytes")
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an unfinished event (non-empty at EOF means the stream was cut)."""
        return self._buf
