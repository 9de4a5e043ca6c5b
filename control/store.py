"""Durable audit log: events as JSON lines, appended, rotated by size, read back on start so
a restarted control plane still answers `baton events` about what came before.

Writes go to a buffered file and are flushed by control's background task a few times a
second, so recording an event never waits on the disk in the routing path."""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import IO, Any

import orjson

from control.events import Event, EventKind


class EventFile:
    def __init__(self, path: Path, *, max_bytes: int = 64 << 20, keep: int = 5) -> None:
        self.path = path
        self._max = max_bytes
        self._keep = keep
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - held open for appends
        self._size = path.stat().st_size
        self._pending: list[Event] = []

    def load(self, limit: int) -> list[Event]:
        """The newest `limit` events over the rotated files, oldest first. Lines that don't
        parse (a torn last line after a crash) are skipped."""
        recent: deque[Event] = deque(maxlen=limit)
        for path in reversed(self._files()):
            with open(path, "rb") as f:
                for line in f:
                    event = _parse(line)
                    if event is not None:
                        recent.append(event)
        return list(recent)

    def append(self, event: Event) -> None:
        """Queued: serialised and written in one go by the next flush()."""
        self._pending.append(event)

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            chunk = b"".join(orjson.dumps(e.to_json()) + b"\n" for e in pending)
            self._file.write(chunk)
            self._size += len(chunk)
            if self._size >= self._max:
                self._rotate()
        self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()

    def _files(self) -> list[Path]:
        """Current file first, then .1, .2, ... (older)."""
        rotated = [self.path.with_name(f"{self.path.name}.{i}") for i in range(1, self._keep + 1)]
        return [p for p in [self.path, *rotated] if p.exists()]

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self._keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = 0


def _parse(line: bytes) -> Event | None:
    try:
        raw: dict[str, Any] = orjson.loads(line)
        data = {
            k: v
            for k, v in raw.items()
            if k not in ("v", "seq", "time", "kind", "request_id", "backend_id")
        }
        return Event(
            int(raw["seq"]),
            float(raw["time"]),
            EventKind(raw["kind"]),
            raw.get("request_id", ""),
            raw.get("backend_id", ""),
            data,
        )
    except (orjson.JSONDecodeError, KeyError, ValueError, TypeError):
        return None
