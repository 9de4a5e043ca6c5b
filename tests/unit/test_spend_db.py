"""control/fleet/spend_db.py: tenants' spend per period in fleet.db survives a restart whole,
written in batches the ledger acknowledges, amounts beyond SQLite's 64-bit integers included."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from baton.budgets import Budget, SpendRow
from baton.pricing import units
from baton.spend import SpendLedger
from control.exceptions import ConfigError
from control.fleet.spend_db import SpendDB

DAY = Budget.of(50, "day")
MONTH = Budget.of(1000, "month", "Europe/Berlin")
T0 = 1_767_225_600.0 + 3600  # 2026-01-01 01:00 UTC


def spent(ledger: SpendLedger, n: int, now: float) -> None:
    for i in range(n):
        rid = f"r{now}-{i}"
        assert ledger.admit(rid, "acme", (DAY, MONTH), units(1, "cost"), now) is None
        ledger.finished(rid, units("0.75", "cost"), now)


def test_a_restarted_control_counts_on_from_what_was_written(tmp_path: Path) -> None:
    db = SpendDB(tmp_path / "fleet.db")
    before = SpendLedger()
    spent(before, 10, T0)
    rows = before.unwritten()
    assert db.save(rows) == 2  # one row per budget period
    before.written(rows, T0)
    assert before.unwritten() == () and before.unwritten_units == 0
    db.close()
    after = SpendLedger()
    after.restore(SpendDB(tmp_path / "fleet.db").load(T0), T0)
    assert after.standing("acme", (DAY, MONTH), T0) == before.standing("acme", (DAY, MONTH), T0)
    assert [s.spent for s in after.standing("acme", (DAY, MONTH), T0)] == [
        units("7.5", "s")] * 2


def test_writing_a_row_again_replaces_it_and_ended_periods_are_history(tmp_path: Path) -> None:
    db = SpendDB(tmp_path / "fleet.db")
    row = SpendRow("acme", "day:UTC:2026-01-01", int(T0 - 3600), int(T0 + 82800), 5, ())
    db.save([row])
    db.save([SpendRow(row.tenant_id, row.key, row.start, row.end, 9, (units(50, "a"),))])
    assert db.load() == [SpendRow(row.tenant_id, row.key, row.start, row.end, 9,
                                  (units(50, "a"),))]  # fmt: skip
    assert db.load(now=T0 + 90_000) == []  # the day is over: not needed to enforce
    assert len(db.history("acme")) == 1 and db.history("other") == []


def test_amounts_beyond_64_bits_round_trip(tmp_path: Path) -> None:
    big = 2**80 + 7  # units: about 1.2 billion currency units
    db = SpendDB(tmp_path / "fleet.db")
    db.save([SpendRow("acme", "month:UTC:2026-01", 0, 2**40, big, ())])
    assert db.load()[0].spent == big


def test_a_damaged_row_refuses_the_start_rather_than_counting_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "fleet.db"
    SpendDB(path).save([SpendRow("acme", "day:UTC:2026-01-01", 0, 2**40, 5, ())])
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE tenant_spend SET spent = 'five'")
    with pytest.raises(ConfigError, match="not a spend"):
        SpendDB(path).load()
