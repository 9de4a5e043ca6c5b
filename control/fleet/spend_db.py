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
value for (tenant, period key), so writing one twice is harmless (an upsert).

Use per tenant, model and UTC day (baton/usage_days.py: requests, tokens, cost) is kept the
same way in its own table, `tenant_usage_day`, for `baton usage export`: written with the
spend, in the same transaction, and kept for as long as the operator keeps fleet.db."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from pathlib import Path

from baton.budgets import SpendRow
from baton.usage_days import DayRow
from control.exceptions import ConfigError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenant_spend (
    tenant TEXT NOT NULL, period TEXT NOT NULL, start INTEGER NOT NULL, end INTEGER NOT NULL,
    spent TEXT NOT NULL, notified TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (tenant, period)
);
CREATE TABLE IF NOT EXISTS tenant_usage_day (
    day TEXT NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL,
    requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, cost TEXT NOT NULL,
    PRIMARY KEY (day, tenant, model)
);
"""
_DAY_COLUMNS = ("day, tenant, model, requests, prompt_tokens, cached_tokens, completion_tokens, "
                "cost")  # fmt: skip


class SpendDB:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        try:
            self._db = sqlite3.connect(path, isolation_level=None)  # explicit BEGIN/COMMIT
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{path}: not a usable fleet database ({exc})") from None

    def save(self, rows: Iterable[SpendRow], days: Iterable[DayRow] = ()) -> int:
        """Write `rows` and `days` (whole values) in one transaction; how many."""
        values = [(r.tenant_id, r.key, r.start, r.end, str(r.spent),
                   ",".join(map(str, r.notified))) for r in rows]  # fmt: skip
        day_values = [(d.day, d.tenant_id, d.model, d.requests, d.prompt_tokens, d.cached_tokens,
                       d.completion_tokens, str(d.cost)) for d in days]  # fmt: skip
        if not values and not day_values:
            return 0
        self._db.execute("BEGIN")
        try:
            self._db.executemany(
                "INSERT INTO tenant_spend (tenant, period, start, end, spent, notified) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, period) DO UPDATE SET "
                "spent = excluded.spent, notified = excluded.notified",
                values,
            )
            self._db.executemany(
                f"INSERT OR REPLACE INTO tenant_usage_day ({_DAY_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                day_values,
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return len(values) + len(day_values)

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

    def days(self, first: str, last: str) -> list[DayRow]:
        """Use rows of UTC days in [first, last] (YYYY-MM-DD)."""
        return read_days(self._db, first, last)

    def close(self) -> None:
        self._db.close()


def read_days(
    db: sqlite3.Connection, first: str, last: str, after: tuple[str, str, str] | None = None,
    limit: int = -1,
) -> list[DayRow]:
    """Use rows of days in [first, last], in (day, tenant, model) order, those after the key
    `after` only, at most `limit` (-1: all)."""
    q = f"SELECT {_DAY_COLUMNS} FROM tenant_usage_day WHERE day >= ? AND day <= ?"
    args: tuple[object, ...] = (first, last)
    if after is not None:
        q += " AND (day, tenant, model) > (?, ?, ?)"
        args += after
    out = []
    for day, tenant, model, n, prompt, cached, completion, cost in db.execute(
        q + " ORDER BY day, tenant, model LIMIT ?", (*args, limit)
    ):
        try:
            out.append(DayRow(tenant, model, day, int(n), int(prompt), int(cached),
                              int(completion), int(cost)))  # fmt: skip
        except ValueError:
            raise ConfigError(f"tenant_usage_day: row ({day}, {tenant}, {model}) has a cost "
                              f"that is not a number ({cost!r})") from None  # fmt: skip
    return out


def read_days_at(
    path: Path, first: str, last: str, after: tuple[str, str, str] | None, limit: int
) -> list[DayRow]:
    """read_days on a connection of its own, for a reader on another thread than the flusher's
    (an export of a year must not hold up control's event loop); [] if there is no file."""
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        db.execute("PRAGMA query_only=ON")
        try:
            return read_days(db, first, last, after, limit)
        except sqlite3.OperationalError:  # a fleet.db from before the table: nothing kept
            return []
    finally:
        db.close()
