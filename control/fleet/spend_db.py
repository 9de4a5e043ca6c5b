"""Tenants' spend per budget period (issue 43), kept in control's data dir beside the fleet's
configuration (the same fleet.db file, its own table), so a restarted control counts on from
what was spent, not from zero.

Spend changes with every request, unlike the configuration, so it is never written on the
routing path: the spend ledger (baton/spend.py) marks what changed, and control writes those
rows in one transaction a second (`SpendFlusher`), then acknowledges them. What a crash can
lose is therefore at most the last second's settled spend (`baton_spend_unwritten`, the
ledger's `unwritten_units`, says how much is at risk now); requests in flight at the crash are
charged again from the shims' reports when control is back.

Amounts are whole units (baton/pricing.py: 10^-12 of a currency unit) kept as decimal text:
SQLite's integers are 64-bit, which holds only 9.2 million currency units. A row is the whole
value for (tenant, period key), so writing one twice is harmless (an upsert)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path

from baton.budgets import SpendRow
from control.exceptions import ConfigError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenant_spend (
    tenant TEXT NOT NULL, period TEXT NOT NULL, start INTEGER NOT NULL, end INTEGER NOT NULL,
    spent TEXT NOT NULL, notified TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (tenant, period)
);
"""


class SpendDB:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(path, isolation_level=None)  # explicit BEGIN/COMMIT
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{path}: not a usable fleet database ({exc})") from None

    def save(self, rows: Iterable[SpendRow]) -> int:
        """Write `rows` (whole values) in one transaction; how many."""
        values = [(r.tenant_id, r.key, r.start, r.end, str(r.spent),
                   ",".join(map(str, r.notified))) for r in rows]  # fmt: skip
        if not values:
            return 0
        self._db.execute("BEGIN")
        try:
            self._db.executemany(
                "INSERT INTO tenant_spend (tenant, period, start, end, spent, notified) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, period) DO UPDATE SET "
                "spent = excluded.spent, notified = excluded.notified",
                values,
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return len(values)

    def load(self, now: float | None = None) -> list[SpendRow]:
        """Every row kept (with `now`: only periods not yet over)."""
        q = "SELECT tenant, period, start, end, spent, notified FROM tenant_spend"
        args: tuple[object, ...] = ()
        if now is not None:
            q += " WHERE end > ?"
            args = (now,)
        out = []
        for tenant, period, start, end, spent, notified in self._db.execute(q + " ORDER BY 1, 2",
                                                                           args):  # fmt: skip
            try:
                amounts = tuple(int(n) for n in notified.split(",") if n)
                out.append(SpendRow(tenant, period, int(start), int(end), int(spent), amounts))
            except ValueError:
                raise ConfigError(f"tenant_spend: row ({tenant}, {period}) is not a spend "
                                  f"({spent!r}, {notified!r})") from None  # fmt: skip
        return out

    def history(self, tenant: str = "") -> list[SpendRow]:
        """Every period kept, ended ones included (for usage reports and export)."""
        rows = self.load()
        return [r for r in rows if not tenant or r.tenant_id == tenant]

    def close(self) -> None:
        self._db.close()
