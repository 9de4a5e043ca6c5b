"""The audit log: every routing decision, failover, retry, health and admin change as a
versioned event. Events carry ids, counts and hashes, never prompt text. Kept in a bounded ring
in memory; readers query it or follow it live.

Routing decisions are one per request, on control's hot path, so they are kept as plain tuples
(`RouteRow`) and become `Event`s only when someone reads them: building an Event with a data
dict per route, and serialising it on its own, cost control 10-15% of its routing throughput."""

# baton: pure

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from control.audit.payloads import EventKind, Payload, data_of

SCHEMA_VERSION = 1
_HEADER = ("v", "seq", "time", "kind", "request_id", "backend_id")  # an event's own fields


class Event(NamedTuple):
    """Immutable like the frozen dataclasses elsewhere, but a tuple: one is made per routing
    decision, and a frozen dataclass costs several times more to build."""

    seq: int
    time: float
    kind: EventKind
    request_id: str = ""
    backend_id: str = ""
    data: Mapping[str, Any] = {}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Event:
        """What to_json wrote (KeyError, ValueError or TypeError: it is not that)."""
        data = {k: v for k, v in raw.items() if k not in _HEADER}
        return cls(int(raw["seq"]), float(raw["time"]), EventKind(raw["kind"]),
                   raw.get("request_id", ""), raw.get("backend_id", ""), data)  # fmt: skip

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


# A routing decision as stored: (seq, time, request_id, backend_id, *ROUTE_FIELDS).
RouteRow = tuple[int, float, str, str, str, str, str, int, int, str, str]
# `detail`: why, in the policy's words (ttft: the estimate and the runner-up); often "".
# `tenant`: the request's tenant id (never its key); "" from an open shim.
ROUTE_FIELDS = ("reason", "policy", "model", "pin_depth", "snapshot", "detail", "tenant")
ROUTE_COLUMNS = ("seq", "time", "request_id", "backend_id", *ROUTE_FIELDS)
Entry = Event | RouteRow  # what the ring and the durable sink hold

Listener = Callable[[Event], None]
Sink = Callable[[Entry], None]
_new_tuple = tuple.__new__


def route_event(row: RouteRow) -> Event:
    data = dict(zip(ROUTE_FIELDS, row[4:], strict=True))
    return Event(row[0], row[1], EventKind.ROUTE, row[2], row[3], data)


def as_event(entry: Entry) -> Event:
    # A RouteRow is a plain tuple; an Event is a tuple subclass.
    return entry if isinstance(entry, Event) else route_event(entry)


class EventLog:
    """`sink` receives every new entry (the durable file); `restored` are events read back
    from it at start, so numbering and queries carry on across restarts; listeners are live
    followers and get Events."""

    def __init__(
        self,
        clock: Callable[[], float],
        capacity: int = 100_000,
        *,
        sink: Sink | None = None,
        restored: Iterable[Entry] = (),
        durable: Callable[[], None] | None = None,
    ) -> None:
        # Called after every event but a routing decision: failovers, retries, health and
        # admin changes are rare and are what an operator audits, so they reach the file at
        # once (a SIGKILL loses none); decisions ride the periodic flush.
        self._durable = durable
        self._clock = clock
        self._events: deque[Entry] = deque(restored, maxlen=capacity)
        self._seq = self._events[-1][0] if self._events else 0
        self._sink = sink
        # A tuple, replaced on (un)subscribe, so record() iterates without copying.
        self._listeners: tuple[Listener, ...] = ()

    def record(self, payload: Payload, *, request_id: str = "", backend_id: str = "") -> Event:
        """An event of the payload's kind, its fields the event's data (payloads.py)."""
        kind, data = payload.KIND, data_of(payload)
        self._seq += 1
        # tuple.__new__ skips the NamedTuple's Python-level constructor: one event is made
        # per routing decision, so this is on control's hot path.
        event = _new_tuple(Event, (self._seq, self._clock(), kind, request_id, backend_id, data))
        self._events.append(event)
        if self._sink is not None:
            self._sink(event)
            if self._durable is not None:
                self._durable()
        for listener in self._listeners:
            listener(event)
        return event

    def record_route(
        self,
        request_id: str,
        *,
        backend_id: str,
        reason: str,
        policy: str,
        model: str,
        pin_depth: int,
        snapshot: int,
        detail: str = "",
        tenant: str = "",
    ) -> None:
        """A routing decision (see the module doc for why it is a row)."""
        self._seq += 1
        row = (self._seq, self._clock(), request_id, backend_id, reason, policy, model,
               pin_depth, snapshot, detail, tenant)  # fmt: skip
        self._events.append(row)
        if self._sink is not None:
            self._sink(row)
        if self._listeners:
            event = route_event(row)
            for listener in self._listeners:
                listener(event)

    def adopt(self, events: Iterable[Event]) -> int:
        """Events another control replica recorded (the last leader's, read from etcd) merged
        into this log by time; one already here (same time, kind, request and backend) is not
        taken twice. Their sequence numbers are the other replica's. Returns how many came."""
        here = {(e[1], e[2], e[3], e[4]) for e in self._events if type(e) is Event}
        new = [e for e in events if (e.time, e.kind, e.request_id, e.backend_id) not in here]
        if new:
            merged = sorted([*self._events, *new], key=lambda e: e[1])
            self._events = deque(merged, maxlen=self._events.maxlen)
        return len(new)

    def query(self, q: EventQuery) -> list[Event]:
        """The newest `limit` matching events, oldest first."""
        found: list[Event] = []
        skip_routes = bool(q.kind) and q.kind != EventKind.ROUTE
        for entry in reversed(self._events):
            if skip_routes and type(entry) is tuple:
                continue
            e = as_event(entry)
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
        return map(as_event, self._events)
