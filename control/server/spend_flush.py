"""Tenants' spend to fleet.db a second (control/fleet/spend_db.py says why in batches): the
spend ledger says what changed, this writes it in one transaction and acknowledges it, and at
start the ledger is given back what was written. Plumbing: the ledger decides, the database
stores. A failed write (a full disk) loses nothing: the rows stay unwritten, tried again at
the next tick, and `baton_spend_unwritten` shows the amount at risk."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable

from baton.spend import SpendLedger
from control.fleet.spend_db import SpendDB

log = logging.getLogger("baton.control.spend")

FLUSH_S = 1.0  # at most this much settled spend is lost to a crash


class SpendFlusher:
    def __init__(self, ledger: SpendLedger, db: SpendDB, clock: Callable[[], float]) -> None:
        self._ledger = ledger
        self._db = db
        self._clock = clock

    def restore(self) -> int:
        """The spend written before a restart, for periods not yet over; how many rows."""
        now = self._clock()
        rows = self._db.load(now)
        self._ledger.restore(rows, now)
        return len(rows)

    def flush(self) -> int:
        """Write what changed since the last flush; how many rows (0 when the write failed:
        they stay unwritten and go at the next one)."""
        rows = self._ledger.unwritten()
        if not rows:
            return 0
        try:
            self._db.save(rows)
        except sqlite3.Error as exc:
            log.warning("tenants' spend not written to fleet.db (kept, tried again): %s", exc)
            return 0
        self._ledger.written(rows, self._clock())
        return len(rows)

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
