"""Durable audit log: events as JSON lines, appended, rotated by size, read back on start so
a restarted control plane still answers `baton events` about what came before.

Writes go to a buffered file and are flushed by control's background task a few times a
second, so recording an event never waits on the disk in the routing path. At a flush, each run
of consecutive routing decisions is written as one line of rows
(`{"v":1,"kind":"route","columns":[...],"rows":[[...],...]}`): orjson serialises a list of
tuples in one call at a tenth of the cost of an object per decision. Every other event is one
object per line."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from control.audit.log import (
    ROUTE_COLUMNS,
    SCHEMA_VERSION,
    Entry,
    Event,
    RouteRow,
)


class EventFile:
    def __init__(self, path: Path, *, max_bytes: int = 64 << 20, keep: int = 5) -> None:
        self.path = path
        self._max = max_bytes
        self._keep = keep
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - held open for appends
        self._size = path.stat().st_size
        self._pending: list[Entry] = []

    def load(self, limit: int) -> list[Entry]:
        """The newest `limit` entries over the rotated files, oldest first. Lines that don't
        parse (a torn last line after a crash) are skipped."""
        recent: deque[Entry] = deque(maxlen=limit)
        for path in reversed(self._files()):
            with open(path, "rb") as f:
                for line in f:
                    recent.extend(_parse(line))
        return list(recent)

    @property
    def append(self) -> Callable[[Entry], None]:
        """The EventLog's sink: queues an entry, serialised and written in one go by the next
        flush(). It is the list's own append (no Python frame per routing decision), so the
        list is emptied in place, never replaced."""
        return self._pending.append

    def flush(self) -> None:
        if self._pending:
            pending = self._pending.copy()
            self._pending.clear()
            chunk = b"".join(_lines(pending))
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


def _lines(pending: list[Entry]) -> Iterator[bytes]:
    rows: list[Entry] = []
    for e in pending:
        if isinstance(e, Event):
            if rows:
                yield _rows_line(rows)
                rows = []
            yield orjson.dumps(e.to_json()) + b"\n"
        else:
            rows.append(e)
    if rows:
        yield _rows_line(rows)


def _rows_line(rows: list[Entry]) -> bytes:
    batch = {"v": SCHEMA_VERSION, "kind": "route", "columns": ROUTE_COLUMNS, "rows": rows}
    return orjson.dumps(batch) + b"\n"


def _parse(line: bytes) -> list[Entry]:
    try:
        raw: dict[str, Any] = orjson.loads(line)
        if "rows" in raw:
            if tuple(raw["columns"]) not in (ROUTE_COLUMNS, ROUTE_COLUMNS[:-1], ROUTE_COLUMNS[:-2]):
                return []  # a layout this version doesn't know (shorter: before tenant, detail)
            return [_row(r) for r in raw["rows"]]
        return [Event.from_json(raw)]
    except (orjson.JSONDecodeError, KeyError, ValueError, TypeError):
        return []


def _row(r: list[Any]) -> RouteRow:
    seq, time, rid, bid, reason, policy, model, depth, snap, *rest = r
    return (int(seq), float(time), str(rid), str(bid), str(reason), str(policy), str(model),
            int(depth), int(snap), str(rest[0]) if rest else "",
            str(rest[1]) if len(rest) > 1 else "")  # fmt: skip
