"""In-flight requests per backend: soft state, rebuilt from traffic, never persisted."""

# baton: pure

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from baton.model import BackendId


class Load:
    """Which backend each in-flight request holds. Entries older than `ttl` are dropped
    so that a shim that died without reporting cannot pin load on a backend forever."""

    def __init__(self, ttl: float = 900.0) -> None:
        self._ttl = ttl
        self._held: dict[str, tuple[BackendId, float]] = {}
        self._counts: Counter[BackendId] = Counter()

    def acquire(self, request_id: str, backend_id: BackendId, now: float) -> None:
        self.release(request_id)
        self._held[request_id] = (backend_id, now)
        self._counts[backend_id] += 1

    def release(self, request_id: str) -> BackendId | None:
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        backend_id = held[0]
        self._counts[backend_id] -= 1
        if self._counts[backend_id] <= 0:
            del self._counts[backend_id]
        return backend_id

    def expire(self, now: float) -> int:
        stale = [rid for rid, (_, t) in self._held.items() if now - t > self._ttl]
        for rid in stale:
            self.release(rid)
        return len(stale)

    def held(self) -> Iterator[tuple[str, BackendId, float]]:
        return ((rid, bid, t) for rid, (bid, t) in list(self._held.items()))

    def counts(self) -> Mapping[BackendId, int]:
        return MappingProxyType(self._counts)

    def total(self) -> int:
        return len(self._held)
