"""Requests waiting for room on a saturated fleet: one queue per model, in priority bands
(interactive, standard, batch); a band is served only while every higher band is empty, and
the tenants of a band share it by weight.

Fair share is deficit round robin over tokens (each request costs its estimated tokens: its
prompt and its max_tokens): every visit gives a tenant `weight x QUANTUM` tokens of credit,
and it sends requests while its credit covers the next one (a large request takes several
visits to afford). Over a backlog, tenants are
served tokens in the ratio of their weights, whatever their requests' sizes, at O(1) a
request; WFQ's virtual finish times would give the same shares with a heap and a clock per
band, and nothing more that matters here (the fleet's slots, not a link, are shared)."""

# baton: pure

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

# Tokens of credit per unit of weight per visit: about one small request, so that tenants'
# turns interleave request by request rather than in long runs.
QUANTUM = 32

T = TypeVar("T")


@dataclass
class Waiting(Generic[T]):
    request_id: str
    tenant: str
    band: int  # 0 first
    weight: int
    cost: int  # estimated tokens
    since: float
    deadline: float
    item: T  # what the caller needs to route it when its turn comes


@dataclass
class _Tenant(Generic[T]):
    weight: int
    deficit: float = 0.0
    waiting: deque[Waiting[T]] = field(default_factory=deque)


class _Band(Generic[T]):
    def __init__(self) -> None:
        # Tenants with requests waiting, in round-robin order (the head's turn is now).
        self.active: OrderedDict[str, _Tenant[T]] = OrderedDict()

    def push(self, w: Waiting[T]) -> None:
        t = self.active.get(w.tenant)
        if t is None:
            t = self.active[w.tenant] = _Tenant(w.weight)
        t.weight = w.weight  # an update of the tenant applies from its next request
        t.waiting.append(w)

    def pop(self) -> Waiting[T] | None:
        """The next request by deficit round robin."""
        while self.active:
            tid, t = next(iter(self.active.items()))
            head = t.waiting[0]
            if t.deficit >= head.cost:
                t.deficit -= head.cost
                t.waiting.popleft()
                if not t.waiting:
                    del self.active[tid]  # an idle tenant keeps no credit
                return head
            # Its turn is over: new credit, and to the back of the round.
            t.deficit += t.weight * QUANTUM
            self.active.move_to_end(tid)
        return None

    def remove(self, request_id: str, tenant: str) -> Waiting[T] | None:
        t = self.active.get(tenant)
        if t is None:
            return None
        for w in t.waiting:
            if w.request_id == request_id:
                t.waiting.remove(w)
                if not t.waiting:
                    del self.active[tenant]
                return w
        return None

    def __iter__(self) -> Iterator[Waiting[T]]:
        for t in self.active.values():
            yield from t.waiting

    def __len__(self) -> int:
        return sum(len(t.waiting) for t in self.active.values())


class Bands(Generic[T]):
    """One model's waiting requests."""

    def __init__(self, bands: int = 3) -> None:
        self._bands: list[_Band[T]] = [_Band() for _ in range(bands)]
        self._tenant_of: dict[str, tuple[str, int]] = {}  # request id -> (tenant, band)

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tenant_of

    def push(self, w: Waiting[T]) -> None:
        self._bands[w.band].push(w)
        self._tenant_of[w.request_id] = (w.tenant, w.band)

    def sizes(self) -> dict[int, int]:
        return {band: len(q) for band, q in enumerate(self._bands)}

    def waiting_at_or_above(self, band: int) -> bool:
        """Whether a request of `band` or a higher one (a lower number) waits."""
        return any(len(q) for q in self._bands[: band + 1])

    def pop(self, allowed: Callable[[int], bool] = lambda band: True) -> Waiting[T] | None:
        """The next request of the highest band that has one, if `allowed(band)`: a band is
        never passed over for a lower one, so when the highest waiting band may not go
        (the room left is kept for higher ones), none goes."""
        for band, queue in enumerate(self._bands):
            if len(queue):
                if not allowed(band):
                    return None
                w = queue.pop()
                if w is not None:
                    del self._tenant_of[w.request_id]
                return w
        return None

    def remove(self, request_id: str) -> Waiting[T] | None:
        where = self._tenant_of.pop(request_id, None)
        if where is None:
            return None
        return self._bands[where[1]].remove(request_id, where[0])

    def expired(self, now: float) -> list[Waiting[T]]:
        """Those whose wait is over its bound, taken out."""
        late = [w for band in self._bands for w in band if w.deadline <= now]
        for w in late:
            self.remove(w.request_id)
        return late

    def lowest_newest(self) -> Waiting[T] | None:
        """Who is shed first when the queue is full: the lowest band's newest request."""
        for band in reversed(self._bands):
            newest = max(band, key=lambda w: w.since, default=None)
            if newest is not None:
                return newest
        return None
