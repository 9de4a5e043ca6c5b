"""Tenants' spend per budget period in etcd, for control replicas (issue 43), as
control/server/spend_flush.py keeps it in fleet.db for a single control:

    PREFIX/spend/END/TENANT/PERIOD   one row: {"tenant", "period", "start", "end",
                                     "spent": decimal text, "notified": [decimal text]}

END (the period's end, unix seconds, 12 digits) leads the key so that the periods not yet
over are one range read, and ended ones are trimmed with one range delete. Amounts are
decimal text: they outgrow 64 bits (baton/pricing.py's units).

Only the leader writes, once a second (FLUSH_S), the rows the ledger marks changed, whole,
in transactions fenced by its term, then acknowledges them (`written`). While etcd does not
answer, nothing is acknowledged: the spend goes on counting in memory and is written when
etcd is back (`baton_spend_unwritten` shows what a crash would lose meanwhile). Followers
write nothing: they hold the leader's spend from the soft-state stream (control/fleet/
journal.py), so a new leader's count is the old one's less at most the stream's last batch
(50 ms). Its first write rewrites every row it holds, since what it replayed may not all be
in etcd yet. A replica that starts, or is elected, first takes from etcd any row it holds
less of (a whole group restarted, or a leader that never had a follower)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import orjson

from baton.budgets import SpendRow
from baton.spend import SpendLedger
from control.replicas import etcd
from control.replicas.etcd import Etcd, EtcdUnavailable

log = logging.getLogger("baton.control.replicas")
T = TypeVar("T")

FLUSH_S = 1.0  # at most this much settled spend is lost to a leader's crash
TXN_ROWS = 100  # rows per transaction: etcd refuses more than 128 operations in one
ENDED_KEPT_S = 7 * 86_400  # an ended period's row stays in etcd this long, for a look
TRIM_EVERY = 3_600  # flushes between trims of ended periods


# -- rows as etcd keeps them (pure) ---------------------------------------------------------


def spend_key(prefix: bytes, row: SpendRow) -> bytes:
    return prefix + f"{row.end:012d}/{row.tenant_id}/{row.key}".encode()


def encode_row(row: SpendRow) -> bytes:
    return orjson.dumps(
        {
            "tenant": row.tenant_id,
            "period": row.key,
            "start": row.start,
            "end": row.end,
            "spent": str(row.spent),
            "notified": [str(n) for n in row.notified],
        }
    )


def decode_row(raw: bytes) -> SpendRow:
    """What `encode_row` wrote; ValueError for anything else."""
    try:
        d = orjson.loads(raw)
        return SpendRow(str(d["tenant"]), str(d["period"]), int(d["start"]), int(d["end"]),
                        int(d["spent"]), tuple(int(n) for n in d["notified"]))  # fmt: skip
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a spend row ({exc})") from None


def to_restore(stored: Iterable[SpendRow], held: Iterable[SpendRow]) -> list[SpendRow]:
    """The stored rows the ledger holds less of (or not at all). Spend in a period only
    grows, so the larger count is the later one: a row the ledger holds more of (from the
    leader's stream, newer than its last write) is kept as it is."""
    have = {(r.tenant_id, r.key): r.spent for r in held}
    return [r for r in stored if r.spent > have.get((r.tenant_id, r.key), -1)]


def batches(rows: Sequence[T], size: int = TXN_ROWS) -> list[Sequence[T]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


# -- the writer (plumbing) ------------------------------------------------------------------


async def write_fenced(
    client: Etcd,
    leader_key: bytes,
    term: int,
    rows: Sequence[T],
    put: Callable[[T], tuple[bytes, bytes]],
    written: Callable[[Sequence[T]], None],
) -> bool:
    """`rows` to etcd in batches (etcd takes at most 128 operations a transaction), each
    transaction fenced on the leader's term, each batch acknowledged (`written`) once it is
    in; False when this replica no longer leads (the new leader writes what is left)."""
    for batch in batches(rows):
        ops = [etcd.put(*put(r)) for r in batch]
        ok, _ = await client.txn([etcd.compare_create(leader_key, term)], ops)
        if not ok:
            return False
        written(batch)
    return True


async def flush_forever(flush: Callable[[], Awaitable[int]], what: str) -> None:
    """`flush` every FLUSH_S; while etcd is away what it would write stays unwritten."""
    while True:
        await asyncio.sleep(FLUSH_S)
        try:
            await flush()
        except EtcdUnavailable as exc:
            log.debug("%s not written to etcd (kept, tried again): %s", what, exc)


class SpendWriter:
    def __init__(
        self,
        ledger: SpendLedger,
        client: Etcd,
        prefix: bytes,
        leader_key: bytes,
        term: Callable[[], int],
        clock: Callable[[], float],
    ) -> None:
        """`prefix`: the store's (PREFIX), `leader_key`: what a write's term is compared
        on, `term()`: this replica's term while it leads (0: it does not)."""
        self._ledger = ledger
        self._etcd = client
        self.prefix = prefix + b"/spend/"
        self._leader_key = leader_key
        self._term = term
        self._clock = clock
        self._wrote_term = 0  # the term this replica last wrote in: a new one rewrites all
        self._flushes = 0
        self._lock = asyncio.Lock()

    async def restore(self) -> int:
        """The rows in etcd of periods not over yet that this replica holds less of; how
        many were taken (EtcdUnavailable: none)."""
        now = self._clock()
        start = self.prefix + f"{int(now) + 1:012d}".encode()
        kvs = await self._etcd.get_range(start, etcd.prefix_end(self.prefix))
        stored = []
        for kv in kvs:
            try:
                stored.append(decode_row(kv.value))
            except ValueError as exc:
                log.warning("spend %s in etcd is unreadable (%s): skipped", kv.key[:200], exc)
        rows = to_restore(stored, self._ledger.rows())
        self._ledger.restore(rows, now)
        return len(rows)

    async def flush(self) -> int:
        """The leader: writes what changed since its last write (everything, the first
        time in a term); how many rows. EtcdUnavailable: none acknowledged, tried again at
        the next flush. A follower acknowledges what it replayed, writing nothing: the
        leader writes it, and the follower's `baton_spend_unwritten` says 0."""
        async with self._lock:
            term = self._term()
            if not term:
                self._ledger.written(self._ledger.unwritten(), self._clock())
                self._wrote_term = 0
                return 0
            led = self._wrote_term == term
            rows = self._ledger.unwritten() if led else self._ledger.rows()
            if not await write_fenced(
                self._etcd, self._leader_key, term, rows,
                lambda r: (spend_key(self.prefix, r), encode_row(r)),
                lambda batch: self._ledger.written(batch, self._clock()),
            ):  # fmt: skip
                return 0  # no longer the leader: the new one writes
            self._wrote_term = term
            self._flushes += 1
            if not led or self._flushes % TRIM_EVERY == 0:
                await self._trim()
            return len(rows)

    async def _trim(self) -> None:
        """Rows of periods that ended over ENDED_KEPT_S ago go: nothing enforces them."""
        before = int(self._clock() - ENDED_KEPT_S)
        await self._etcd.delete_range(self.prefix, self.prefix + f"{before:012d}".encode())

    async def run(self) -> None:
        await flush_forever(self.flush, "tenants' spend")
