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


def event(raw: bytes) -> Event:
    """One event from its bytes without the blank line that ended it."""
    return _event(Event, (raw + b"\n\n", _data_of(raw)))


def whole_event(block: bytes) -> Event:
    """The event of a block that is one whole event, blank line included."""
    return _event(Event, (block, _data_of(block[:-2])))


def events_of(block: bytes, max_event_bytes: int = 8 * 1024 * 1024) -> list[Event]:
    """The events of a block of whole ones (SSEParser.feed_block), split left to right at
    each blank line (as splitting the block at b"\\n\\n" does)."""
    if block.endswith(b"\n\n") and block.find(b"\n\n") == len(block) - 2:
        # One event, what an engine sends a token at a time: nothing to search.
        if len(block) - 2 > max_event_bytes:
            raise ValueError(f"SSE event larger than {max_event_bytes} bytes")
        return [_event(Event, (block, _data_of(block[:-2])))]
    events: list[Event] = []
    start = 0
    while True:
        end = block.find(b"\n\n", start)
        if end < 0:
            return events
        if end - start > max_event_bytes:
            raise ValueError(f"SSE event larger than {max_event_bytes} bytes")
        events.append(_event(Event, (block[start : end + 2], _data_of(block[start:end]))))
        start = end + 2


def _events_end(buf: bytes) -> int:
    """Where the last complete event of `buf` ends (0: none), as a left-to-right search for
    blank lines finds it, without searching event by event. The last b"\\n\\n" ends a run of
    newlines (one more after it would make a later one), and such a search enters the run at
    its start (after a byte that is not a newline, or at the buffer's start, where the
    previous search left off) and consumes it two at a time."""
    last = buf.rfind(b"\n\n")
    if last < 0:
        return 0
    run_start = last
    while run_start > 0 and buf[run_start - 1] == 10:  # b"\\n"; rarely more than once
        run_start -= 1
    run = last + 2 - run_start
    return run_start + run - run % 2


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
    buffered until completed. The events do not depend on how the stream was cut into reads.

    feed_block() gives the same events as one block of bytes (each event's raw bytes in
    order), unsplit: the relay's run of plain token chunks is handled as a whole
    (dataplane/relay/runs.py), and only what is not is split, by events_of()."""

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._buf = b""
        self._max = max_event_bytes
        self._after_cr = False  # the last chunk ended in \\r: a leading \\n ends the same line

    def feed(self, chunk: bytes) -> list[Event]:
        return events_of(self.feed_block(chunk), self._max)

    def feed_block(self, chunk: bytes) -> bytes:
        """The complete events so far, normalised, as one block (b"" when none is complete)."""
        if not chunk:
            return b""
        # Each chunk is normalised once, before joining the buffer: normalising the joined
        # buffer again would turn "\\r\\r\\n" into a different event depending on the cut.
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not self._buf and chunk.endswith(b"\n\n") and chunk[-3:-2] != b"\n":
            # Whole events and nothing after them (an engine writes an event at a time): no
            # buffer joined, searched or kept.
            if len(chunk) > self._max:
                events_of(chunk, self._max)
            return chunk
        buf = self._buf + chunk if self._buf else chunk
        end = _events_end(buf)
        block, self._buf = (buf[:end], buf[end:]) if end < len(buf) else (buf, b"")
        if len(self._buf) - self._buf.endswith(b"\n") > self._max:
            raise ValueError(f"SSE event larger than {self._max} bytes")
        if len(block) > self._max:  # however it arrived: the same limit for every cut
            events_of(block, self._max)
        return block

    @property
    def pending(self) -> bytes:
        """Bytes of an unfinished event (non-empty at EOF means the stream was cut)."""
        return self._buf
