"""Use per tenant, model and UTC day (baton/usage_days.py) in etcd, for control replicas, as
control/server/spend_flush.py keeps it in fleet.db for a single control:

    PREFIX/usage/DAY/TENANT\\0MODEL   one row: {"tenant", "model", "day", "requests",
                                     "prompt", "cached", "completion", "cost": decimal text}

The key's order is the rows' (day, tenant, model) order, so `baton usage export` pages
through etcd as through fleet.db: DAY is fixed-width, and a NUL (below any character a
tenant or model name has) ends the tenant, where a "/" would put "team-a" before "team".
Kept for good, as fleet.db keeps them: an export of any range reads them.

Written as the spend is (spend.py): only the leader, once a second, the rows that changed,
whole, in transactions fenced by its term, then acknowledged (`written`); nothing is
acknowledged while etcd does not answer. Followers hold the leader's rows from the soft-state
stream; a new leader's first write rewrites every row it holds. A replica that starts, or is
elected, takes from etcd today's rows it holds fewer requests of (older days are etcd's to
answer for, and an export reads them there)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import orjson

from baton.usage_days import DayRow, Key, UsageDays, day_of
from control.exceptions import StoreUnavailable
from control.replicas import etcd
from control.replicas.etcd import Etcd, EtcdUnavailable
from control.replicas.spend import flush_forever, write_fenced

log = logging.getLogger("baton.control.replicas")


# -- rows as etcd keeps them (pure) ---------------------------------------------------------


def day_key(prefix: bytes, key: Key) -> bytes:
    day, tenant, model = key
    return prefix + f"{day}/{tenant}\0{model}".encode()


def encode_day(row: DayRow) -> bytes:
    return orjson.dumps(
        {
            "tenant": row.tenant_id,
            "model": row.model,
            "day": row.day,
            "requests": row.requests,
            "prompt": row.prompt_tokens,
            "cached": row.cached_tokens,
            "completion": row.completion_tokens,
            "cost": str(row.cost),
        }
    )


def decode_day(raw: bytes) -> DayRow:
    """What `encode_day` wrote; ValueError for anything else."""
    try:
        d = orjson.loads(raw)
        return DayRow(str(d["tenant"]), str(d["model"]), str(d["day"]), int(d["requests"]),
                      int(d["prompt"]), int(d["cached"]), int(d["completion"]),
                      int(d["cost"]))  # fmt: skip
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a usage row ({exc})") from None


def day_range(prefix: bytes, first: str, last: str, after: Key | None) -> tuple[bytes, bytes]:
    """The keys of days in [first, last] past the row `after`: [start, end)."""
    start = prefix + first.encode() + b"/"
    if after is not None:
        start = max(start, day_key(prefix, after) + b"\0")  # the first key past it
    return start, prefix + last.encode() + b"0"  # "0" is "/" + 1: all of `last`


def to_restore(stored: Iterable[DayRow], held: Iterable[DayRow]) -> list[DayRow]:
    """The stored rows the book holds fewer requests of (or none). A day's row only grows,
    so the larger count is the later one: a row held with as many or more (from the leader's
    stream, newer than its last write) is kept as it is."""
    have = {r.key: r.requests for r in held}
    return [r for r in stored if r.requests > have.get(r.key, -1)]


def decoded(kvs: Iterable[etcd.KeyValue]) -> list[DayRow]:
    out = []
    for kv in kvs:
        try:
            out.append(decode_day(kv.value))
        except ValueError as exc:
            log.warning("usage %r in etcd is unreadable (%s): skipped", kv.key[:200], exc)
    return out


# -- the writer (plumbing) ------------------------------------------------------------------


class DaysWriter:
    def __init__(
        self,
        days: UsageDays,
        client: Etcd,
        prefix: bytes,
        leader_key: bytes,
        term: Callable[[], int],
        clock: Callable[[], float],
    ) -> None:
        """As SpendWriter: `prefix` the store's, `term()` this replica's while it leads."""
        self._days = days
        self._etcd = client
        self.prefix = prefix + b"/usage/"
        self._leader_key = leader_key
        self._term = term
        self._clock = clock
        self._wrote_term = 0  # the term this replica last wrote in: a new one rewrites all
        self._lock = asyncio.Lock()

    async def restore(self) -> int:
        """Today's rows in etcd this replica holds fewer requests of; how many were taken
        (EtcdUnavailable: none)."""
        now = self._clock()
        today = day_of(now)
        start, end = day_range(self.prefix, today, today, None)
        stored = decoded(await self._etcd.get_range(start, end))
        rows = to_restore(stored, self._days.rows(today, today))
        self._days.restore(rows, now)
        return len(rows)

    async def stored_days(
        self, first: str, last: str, after: Key | None, limit: int
    ) -> list[DayRow]:
        """Rows as etcd has them, in (day, tenant, model) order (control/api/admin_usage.py
        lays what is not written yet over them)."""
        start, end = day_range(self.prefix, first, last, after)
        try:
            return decoded(await self._etcd.get_range(start, end, limit))
        except EtcdUnavailable as exc:
            raise StoreUnavailable(f"use per day is kept in etcd: {exc}") from None

    async def flush(self) -> int:
        """The leader: writes the rows changed since its last write (all it holds, the first
        time in a term); how many. EtcdUnavailable: none acknowledged, tried again at the
        next flush. A follower acknowledges what it replayed, writing nothing."""
        async with self._lock:
            term = self._term()
            if not term:
                self._days.written(self._days.unwritten(), self._clock())
                self._wrote_term = 0
                return 0
            rows = self._days.unwritten() if self._wrote_term == term else self._days.rows()
            if not await write_fenced(
                self._etcd, self._leader_key, term, rows,
                lambda r: (day_key(self.prefix, r.key), encode_day(r)),
                lambda batch: self._days.written(batch, self._clock()),
            ):  # fmt: skip
                return 0  # no longer the leader: the new one writes
            self._wrote_term = term
            return len(rows)

    async def run(self) -> None:
        await flush_forever(self.flush, "use per day")
