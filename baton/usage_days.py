"""Usage per (tenant, model, UTC day): requests, prompt, cached and completion tokens and cost
in units (baton/pricing.py), what `baton tenants usage --by` and `baton usage export` read.
Control feeds it where it settles a request's end, beside the spend ledger (baton/spend.py).

- A request counts once per request id (a failover and its resume are one request), on the
  UTC day it ended, and only when a backend served it (an engine's 4xx or a request no
  backend took used nothing). Its cost is what its usage costs at the model's price; one
  whose usage never came (a client gone mid-stream) counts as a request with no tokens and
  no cost, though a budget keeps charging it its estimate.
- Persistence as the spend ledger's: `unwritten()` whole rows since the last write,
  acknowledged with `written()` (a failed write leaves them unwritten), and `restore()` of
  today's rows after a restart, so a day's row counts on from what was stored.
- Bounded: memory holds rows of the last KEEP_DAYS days (tenants are the operator's, models
  the fleet's) plus any not yet written; older days live in the store only."""

# baton: pure

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime

KEEP_DAYS = 2  # days before today kept in memory once written
DONE_KEPT = 65_536  # ends remembered, so one reported twice counts once
DAY_S = 86_400

Key = tuple[str, str, str]  # (day, tenant, model): the order rows are listed in


@dataclass(frozen=True, slots=True)
class DayRow:
    """A tenant's use of one model on one UTC day (`day`: YYYY-MM-DD); `cost` in units."""

    tenant_id: str
    model: str
    day: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost: int = 0

    @property
    def key(self) -> Key:
        return (self.day, self.tenant_id, self.model)


def day_of(t: float) -> str:
    """The UTC day of instant `t` (unix seconds), as rows name it."""
    return datetime.fromtimestamp(t, UTC).date().isoformat()


def day_start(day: str) -> int:
    """Unix seconds at the start of UTC `day`; a ValueError for a malformed one."""
    return int(datetime.combine(date.fromisoformat(day), datetime.min.time(), UTC).timestamp())


class _Row:
    __slots__ = ("requests", "prompt", "cached", "completion", "cost")

    def __init__(self, r: DayRow | None = None) -> None:
        self.requests = r.requests if r else 0
        self.prompt = r.prompt_tokens if r else 0
        self.cached = r.cached_tokens if r else 0
        self.completion = r.completion_tokens if r else 0
        self.cost = r.cost if r else 0

    def row(self, k: Key) -> DayRow:
        return DayRow(k[1], k[2], k[0], self.requests, self.prompt, self.cached,
                      self.completion, self.cost)  # fmt: skip


class UsageDays:
    def __init__(self) -> None:
        self._rows: dict[Key, _Row] = {}
        self._dirty: set[Key] = set()
        self._done: set[str] = set()
        self._done_order: deque[str] = deque()
        # The day of the last end and when it ends: day_of() is not paid per request.
        self._day, self._day_end = "", 0.0

    def add(
        self,
        request_id: str,
        tenant_id: str,
        model: str,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        cost: int,
        now: float,
    ) -> bool:
        """A request of the tenant ended, served, at `now`: counted on today's row (False:
        this request id was counted already)."""
        if request_id:
            if request_id in self._done:
                return False
            self._done.add(request_id)
            self._done_order.append(request_id)
            if len(self._done_order) > DONE_KEPT:
                self._done.discard(self._done_order.popleft())
        if not self._day_end - DAY_S <= now < self._day_end:
            self._day, self._day_end = day_of(now), (now // DAY_S + 1) * DAY_S
        k = (self._day, tenant_id, model)
        r = self._rows.get(k)
        if r is None:
            r = self._rows[k] = _Row()
        r.requests += 1
        r.prompt += max(prompt_tokens, 0)
        r.cached += min(max(cached_tokens, 0), max(prompt_tokens, 0))
        r.completion += max(completion_tokens, 0)
        r.cost += max(cost, 0)
        self._dirty.add(k)
        return True

    def rows(self, first_day: str = "", last_day: str = "") -> tuple[DayRow, ...]:
        """Rows held, written or not, of days in [first_day, last_day] ("": unbounded), in
        (day, tenant, model) order."""
        return tuple(self._rows[k].row(k) for k in sorted(self._rows)
                     if (not first_day or k[0] >= first_day)
                     and (not last_day or k[0] <= last_day))  # fmt: skip

    # -- persistence ------------------------------------------------------------------------

    def unwritten(self) -> tuple[DayRow, ...]:
        """Rows changed since last stored (whole values: a write can be repeated)."""
        return tuple(self._rows[k].row(k) for k in sorted(self._dirty))

    def written(self, rows: Iterable[DayRow], now: float) -> None:
        """`rows` are stored: those not changed since are clean, and clean rows of days
        before the last KEEP_DAYS are let go."""
        for r in rows:
            held = self._rows.get(r.key)
            if held is not None and held.row(r.key) == r:
                self._dirty.discard(r.key)
        oldest = day_of(now - KEEP_DAYS * DAY_S)
        for k in [k for k in self._rows if k[0] < oldest and k not in self._dirty]:
            del self._rows[k]

    def restore(self, rows: Iterable[DayRow], now: float) -> None:
        """Rows as stored, after a restart: today's are counted on from (older days are the
        store's to answer for)."""
        today = day_of(now)
        for r in rows:
            if r.day == today:
                self._rows[r.key] = _Row(r)
                self._dirty.discard(r.key)


def merge(stored: Iterable[DayRow], held: Iterable[DayRow]) -> list[DayRow]:
    """The store's rows with the ones held in memory over them (a held row is the whole value,
    at least as new as the stored one), in (day, tenant, model) order."""
    out = {r.key: r for r in stored}
    out.update((r.key, r) for r in held)
    return [out[k] for k in sorted(out)]
