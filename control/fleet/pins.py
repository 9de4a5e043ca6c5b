"""Prefix-affinity pins: which backend served a message-level prefix (by its chain hash),
so a conversation's next turn can go where its KV cache is. Soft state, bounded by an LRU
capacity and a TTL; time comes in as `now`, never read here."""

# baton: pure

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from baton.model import BackendId


@dataclass(frozen=True, slots=True)
class Pin:
    prefix: bytes  # chain hash h_i of the first `depth` messages
    backend_id: BackendId
    depth: int
    created: float
    last_used: float
    hits: int = 0


@dataclass(frozen=True, slots=True)
class PinMatch:
    pin: Pin
    index: int  # position in the request's chain: the match covers messages 0..index


class PinView(Protocol):
    """What readers outside the registry (admin, metrics) see of the pins: how many, and
    each one. Only the registry changes them, so reads are typed without the mutators."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Pin]: ...


class PinTable:
    def __init__(self, capacity: int = 100_000, ttl: float = 1800.0) -> None:
        self._capacity = capacity
        self._ttl = ttl
        self._pins: OrderedDict[bytes, Pin] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self._pins.values()))

    def longest(self, chain: Sequence[bytes], now: float) -> PinMatch | None:
        """The longest prefix of `chain` that is pinned and not expired."""
        for i in range(len(chain) - 1, -1, -1):
            pin = self._pins.get(chain[i])
            if pin is None:
                continue
            if now - pin.last_used > self._ttl:
                del self._pins[chain[i]]
                continue
            return PinMatch(pin, i)
        return None

    def touch(self, match: PinMatch, now: float) -> None:
        """A request followed this pin: it stays warm (LRU and TTL)."""
        pin = self._pins.get(match.pin.prefix)
        if pin is not None:
            self._pins[pin.prefix] = Pin(
                pin.prefix, pin.backend_id, pin.depth, pin.created, now, pin.hits + 1
            )
            self._pins.move_to_end(pin.prefix)

    def pin(self, prefix: bytes, backend_id: BackendId, depth: int, now: float) -> None:
        old = self._pins.pop(prefix, None)
        same = old is not None and old.backend_id == backend_id
        created = old.created if same and old is not None else now
        hits = old.hits if same and old is not None else 0
        self._pins[prefix] = Pin(prefix, backend_id, depth, created, now, hits)
        while len(self._pins) > self._capacity:
            self._pins.popitem(last=False)

    def restore(self, pin: Pin) -> None:
        """A pin as another replica holds it (its times and hits kept)."""
        self._pins.pop(pin.prefix, None)
        self._pins[pin.prefix] = pin
        while len(self._pins) > self._capacity:
            self._pins.popitem(last=False)

    def pin_chain(self, chain: Sequence[bytes], backend_id: BackendId, now: float) -> None:
        for depth, prefix in enumerate(chain, start=1):
            self.pin(prefix, backend_id, depth, now)

    def drop_backend(self, backend_id: str) -> int:
        stale = [k for k, p in self._pins.items() if p.backend_id == backend_id]
        for k in stale:
            del self._pins[k]
        return len(stale)

    def clear(self) -> int:
        n = len(self._pins)
        self._pins.clear()
        return n

    def expire(self, now: float) -> int:
        stale = [k for k, p in self._pins.items() if now - p.last_used > self._ttl]
        for k in stale:
            del self._pins[k]
        return len(stale)
