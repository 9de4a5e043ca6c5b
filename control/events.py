"""The audit log: every failover, retry, health and admin change as a versioned event.
Events carry ids, counts and hashes, never prompt text. Kept in a bounded ring in memory;
readers query it or follow it live."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

SCHEMA_VERSION = 1


class EventKind(StrEnum):
    ROUTE = "route"
    RETRY = "retry"
    FAILOVER = "failover"
    HEALTH = "health"
    ADMIN = "admin"


class Event(NamedTuple):
    """Immutable like the frozen dataclasses elsewhere, but a tuple: one is made per routing
    decision, and a frozen dataclass costs several times more to build."""

    seq: int
    time: float
    kind: EventKind
    request_id: str = ""
    backend_id: str = ""
    data: Mapping[str, Any] = {}

    def to_json(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "seq": self.seq,
            "time": self.time,
            "kind": self.kind.value,
            "request_id": self.request_id,
            "backend_id": self.backend_id,
            **self.data,
        }


@dataclass(frozen=True, slots=True)
class EventQuery:
    kind: str = ""
    request_id: str = ""
    backend_id: str = ""
    since: float = 0.0
    limit: int = 1000

    def matches(self, e: Event) -> bool:
        return (
            (not self.kind or e.kind == self.kind)
            and (not self.request_id or e.request_id == self.request_id)
            and (not self.backend_id or e.backend_id == self.backend_id)
            and e.time >= self.since
        )


Listener = Callable[[Event], None]
_new_tuple = tuple.__new__


class EventLog:
    """`sink` receives every new event (the durable file); `restored` are events read back
    from it at start, so numbering and queries carry on across restarts."""

    def __init__(
        self,
        clock: Callable[[], float],
        capacity: int = 100_000,
        *,
        sink: Listener | None = None,
        restored: Iterable[Event] = (),
    ) -> None:
        self._clock = clock
        self._events: deque[Event] = deque(restored, maxlen=capacity)
        self._seq = self._events[-1].seq if self._events else 0
        # A tuple, replaced on (un)subscribe, so record() iterates without copying.
        self._listeners: tuple[Listener, ...] = (sink,) if sink is not None else ()

    def record(
        self, kind: EventKind, *, request_id: str = "", backend_id: str = "", **data: Any
    ) -> Event:
        self._seq += 1
        # tuple.__new__ skips the NamedTuple's Python-level constructor: one event is made
        # per routing decision, so this is on control's hot path.
        event = _new_tuple(Event, (self._seq, self._clock(), kind, request_id, backend_id, data))
        self._events.append(event)
        for listener in self._listeners:
            listener(event)
        return event

    def query(self, q: EventQuery) -> list[Event]:
        """The newest `limit` matching events, oldest first."""
        found: list[Event] = []
        for e in reversed(self._events):
            if q.matches(e):
                found.append(e)
                if len(found) >= q.limit:
                    break
        found.reverse()
        return found

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)
