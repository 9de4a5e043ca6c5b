"""Tenants' spend to fleet.db a second (control/fleet/spend_db.py says why in batches): the
spend ledger says what changed, this writes it in one transaction and acknowledges it, and at
start the ledger is given back what was written. Plumbing: the ledger decides, the database
stores. A failed write (a full disk) loses nothing: the rows stay unwritten, tried again at
the next tick, and `baton_spend_unwritten` shows the amount at risk. Use per tenant, model and
UTC day (baton/usage_days.py) goes the same way, in the same transaction."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable

from baton.spend import SpendLedger
from baton.usage_days import DayRow, Key, UsageDays, day_of
from control.fleet.spend_db import SpendDB, read_days_at

log = logging.getLogger("baton.control.spend")

FLUSH_S = 1.0  # at most this much settled spend is lost to a crash


class SpendFlusher:
    def __init__(
        self,
        ledger: SpendLedger,
        db: SpendDB,
        clock: Callable[[], float],
        days: UsageDays | None = None,
    ) -> None:
        self._ledger = ledger
        self._db = db
        self._clock = clock
        self._days = days if days is not None else UsageDays()

    def restore(self) -> int:
        """The spend written before a restart, for periods not yet over, and today's use;
        how many rows."""
        now = self._clock()
        rows = self._db.load(now)
        self._ledger.restore(rows, now)
        day = day_of(now)
        today = self._db.days(day, day)
        self._days.restore(today, now)
        return len(rows) + len(today)

    def flush(self) -> int:
        """Write what changed since the last flush; how many rows (0 when the write failed:
        they stay unwritten and go at the next one)."""
        rows, days = self._ledger.unwritten(), self._days.unwritten()
        if not rows and not days:
            return 0
        try:
            self._db.save(rows, days)
        except sqlite3.Error as exc:
            log.warning("tenants' spend not written to fleet.db (kept, tried again): %s", exc)
            return 0
        now = self._clock()
        self._ledger.written(rows, now)
        self._days.written(days, now)
        return len(rows) + len(days)

    async def stored_days(
        self, first: str, last: str, after: Key | None, limit: int
    ) -> list[DayRow]:
        """Use rows as fleet.db has them (control/api/admin_usage.py adds what is not written
        yet), read on a thread with a connection of its own."""
        return await asyncio.to_thread(read_days_at, self._db.path, first, last, after, limit)

    def close(self) -> None:
        self.flush()
        self._db.close()

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(FLUSH_S)
                self.flush()
        finally:
            self.flush()  # control stopping: the last second's spend too
