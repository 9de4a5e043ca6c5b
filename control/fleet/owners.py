"""Ownership pins: which backend holds a stored response. vLLM keeps a Responses API response
(`store`, the default) in that one server's memory, so a follow-up naming it
(`previous_response_id`, or retrieve/delete/cancel by id) can only be served there. Unlike a
prefix pin, which is a preference a policy may overrule, an ownership pin is a fact: the
router sends the request to its owner or refuses it, saying where the response was.

Bounded like the prefix pins: least recently used first out, and forgotten after `ttl`
seconds without use. An owner that dies or is removed keeps its pins until they age out, so
a follow-up can still be told which backend had its response."""

# baton: pure

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Owned:
    key: str  # the stored object's id, e.g. a response id
    backend_id: str
    model: str
    created: float
    last_used: float
    hits: int = 0


class OwnerTable:
    def __init__(self, capacity: int = 100_000, ttl: float = 86_400.0) -> None:
        self._capacity = capacity
        self._ttl = ttl
        self._owned: OrderedDict[str, Owned] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._owned)

    def __iter__(self) -> Iterator[Owned]:
        return iter(list(self._owned.values()))

    def record(self, key: str, backend_id: str, model: str, now: float) -> None:
        """`backend_id` now holds `key` (a re-record moves it: the engine said so)."""
        self._owned.pop(key, None)
        self._owned[key] = Owned(key, backend_id, model, now, now)
        while len(self._owned) > self._capacity:
            self._owned.popitem(last=False)

    def release(self, key: str) -> bool:
        """The object was deleted on its owner. True when it was known."""
        return self._owned.pop(key, None) is not None

    def owner(self, key: str, now: float) -> Owned | None:
        """Who holds `key`, if it is known and not expired; a lookup keeps it warm."""
        owned = self._owned.get(key)
        if owned is None:
            return None
        if now - owned.last_used > self._ttl:
            del self._owned[key]
            return None
        used = Owned(owned.key, owned.backend_id, owned.model, owned.created, now, owned.hits + 1)
        self._owned[key] = used
        self._owned.move_to_end(key)
        return used
