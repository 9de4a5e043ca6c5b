"""Pure SSE framing: split a byte stream into events, keeping each event's raw bytes so
the relay can forward them untouched (no re-serialisation on the hot path)."""

from __future__ import annotations

from dataclasses import dataclass

DONE = b"[DONE]"


@dataclass(frozen=True, slots=True)
class Event:
    raw: bytes  # the whole event including its terminating blank line
    data: bytes  # the joined `data:` field(s); b"" for comment/keep-alive events

    @property
    def is_done(self) -> bool:
        return self.data == DONE


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
    Accepts \\n, \\r\\n line endings; a partial event stays buffered until completed."""

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._buf = b""
        self._max = max_event_bytes

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            block = buf[start:end]
            events.append(Event(block + b"\n\n", _data_of(block)))
            start = end + 2
        self._buf = buf[start:]
        if len(self._buf) > self._max:
            raise ValueError(f"SSE event larger than {self._max} bytes")
        return events

    @property
    def pending(self) -> bytes:
        """Bytes of an unfinished event (non-empty at EOF means the stream was cut)."""
        return self._buf
