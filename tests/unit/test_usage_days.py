"""baton/usage_days.py and its persistence: use per tenant, model and UTC day counts each
request once, on the day it ended, keeps what is not written until it is, lets go of old
written days, and comes back after a restart from fleet.db (exact, beyond 64-bit costs)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from baton.pricing import PriceTable, units
from baton.spend import SpendLedger
from baton.tenancy import Tenant
from baton.usage_days import DAY_S, KEEP_DAYS, DayRow, UsageDays, day_of, day_start, merge
from control.fleet.spend_db import SpendDB, read_days_at
from control.fleet.tenants import TenantBook
from control.server.spend_flush import SpendFlusher

T0 = 1_767_225_600.0 + 3600  # 2026-01-01 01:00 UTC
TODAY, YESTERDAY = "2026-01-01", "2025-12-31"


@pytest.mark.parametrize(
    ("t", "day"),
    [(T0, TODAY), (T0 - 3600, TODAY), (T0 - 3600.001, YESTERDAY),
     (T0 + 22 * 3600 + 3599.999, TODAY), (T0 + 23 * 3600, "2026-01-02")],
)  # fmt: skip
def test_a_day_is_the_utc_day(t: float, day: str) -> None:
    assert day_of(t) == day
    assert day_start(day) <= t < day_start(day) + DAY_S


def test_requests_count_once_on_the_day_they_ended_per_tenant_and_model() -> None:
    days = UsageDays()
    assert days.add("r1", "acme", "m1", 100, 40, 10, 7, T0)
    assert days.add("r2", "acme", "m1", 50, 0, 5, 3, T0 + 60)
    assert not days.add("r1", "acme", "m1", 100, 40, 10, 7, T0 + 61)  # reported again
    assert days.add("r3", "acme", "m2", 10, 0, 1, 1, T0)
    assert days.add("r4", "beta", "m1", 1, 0, 1, 1, T0 - 7200)  # yesterday
    assert days.rows() == (
        DayRow("beta", "m1", YESTERDAY, 1, 1, 0, 1, 1),
        DayRow("acme", "m1", TODAY, 2, 150, 40, 15, 10),
        DayRow("acme", "m2", TODAY, 1, 10, 0, 1, 1),
    )
    assert days.rows(TODAY, TODAY) == days.rows()[1:]
    assert days.rows("", YESTERDAY) == days.rows()[:1]


def test_counts_from_an_engine_are_clamped_to_sense() -> None:
    days = UsageDays()
    days.add("r", "acme", "m", 10, 50, -3, -1, T0)
    assert days.rows() == (DayRow("acme", "m", TODAY, 1, 10, 10, 0, 0),)


def test_unwritten_until_written_and_a_change_after_the_read_stays_unwritten() -> None:
    days = UsageDays()
    days.add("r1", "acme", "m", 10, 0, 1, 5, T0)
    rows = days.unwritten()
    days.add("r2", "acme", "m", 10, 0, 1, 5, T0)  # between the read and the write's ack
    days.written(rows, T0)
    assert days.unwritten() == (DayRow("acme", "m", TODAY, 2, 20, 0, 2, 10),)
    days.written(days.unwritten(), T0)
    assert days.unwritten() == ()
    assert days.rows() == (DayRow("acme", "m", TODAY, 2, 20, 0, 2, 10),)  # still held


def test_memory_keeps_only_recent_days_once_written() -> None:
    days = UsageDays()
    for d in range(5):
        days.add(f"r{d}", "acme", "m", 1, 0, 1, 1, T0 + d * DAY_S)
    now = T0 + 4 * DAY_S
    old = days.unwritten()[0]
    days.written(days.unwritten()[1:], now)  # the oldest day's write failed
    kept = {r.day for r in days.rows()}
    assert kept == {old.day} | {day_of(now - k * DAY_S) for k in range(KEEP_DAYS + 1)}
    days.written([old], now)
    assert {r.day for r in days.rows()} == {day_of(now - k * DAY_S) for k in range(KEEP_DAYS + 1)}


def test_held_rows_win_over_stored_ones() -> None:
    stored = [DayRow("acme", "m", TODAY, 1, 1, 0, 1, 1), DayRow("acme", "m", YESTERDAY, 3)]
    held = [DayRow("acme", "m", TODAY, 2, 2, 0, 2, 2)]
    assert merge(stored, held) == [stored[1], held[0]]


def test_a_restarted_control_counts_on_from_todays_stored_rows(tmp_path: Path) -> None:
    big = 2**70  # units: beyond SQLite's 64-bit integers
    before = UsageDays()
    before.add("r1", "acme", "m", 10, 2, 3, big, T0)
    before.add("r0", "acme", "m", 1, 0, 1, 5, T0 - 7200)  # yesterday: the store's only
    db = SpendDB(tmp_path / "fleet.db")
    assert db.save((), before.unwritten()) == 2
    before.written(before.unwritten(), T0)
    db.close()
    after = UsageDays()
    flusher = SpendFlusher(SpendLedger(), SpendDB(tmp_path / "fleet.db"), lambda: T0, after)
    assert flusher.restore() == 1
    after.add("r2", "acme", "m", 10, 0, 3, 1, T0)
    assert after.rows() == (DayRow("acme", "m", TODAY, 2, 20, 2, 6, big + 1),)
    assert after.unwritten() == after.rows()
    assert flusher.flush() == 1 and after.unwritten() == ()
    stored = asyncio.run(flusher.stored_days("0000", TODAY, None, -1))
    assert stored == [DayRow("acme", "m", YESTERDAY, 1, 1, 0, 1, 5), *after.rows()]
    # Pages: after a key, at most so many.
    assert read_days_at(tmp_path / "fleet.db", "0000", TODAY, stored[0].key, 5) == stored[1:]
    assert read_days_at(tmp_path / "fleet.db", "0000", TODAY, None, 1) == stored[:1]
    flusher.close()


def test_a_failed_write_keeps_the_rows_for_the_next(tmp_path: Path) -> None:
    days = UsageDays()
    db = SpendDB(tmp_path / "fleet.db")
    flusher = SpendFlusher(SpendLedger(), db, lambda: T0, days)
    days.add("r", "acme", "m", 1, 0, 1, 1, T0)
    locker = sqlite3.connect(tmp_path / "fleet.db", timeout=0)
    locker.execute("BEGIN EXCLUSIVE")
    db._db.execute("PRAGMA busy_timeout=0")
    assert flusher.flush() == 0 and len(days.unwritten()) == 1
    locker.rollback()
    locker.close()
    assert flusher.flush() == 1 and days.unwritten() == ()
    flusher.close()


def test_the_tenant_book_counts_a_served_end_once_at_its_price() -> None:
    prices = PriceTable.parse({"m": {"input": 1000, "output": 2000, "cached_input": 100}})
    book = TenantBook([Tenant("acme")], prices=prices)
    for rid in ("a", "b"):
        assert book.admit(rid, "acme", "m", 50, T0).refused is None
    book.finished("a", 40, 8, T0, model="m", cached_tokens=10)
    book.finished("a", 40, 8, T0, model="m", cached_tokens=10, tenant_id="acme")  # again
    book.finished("b", 0, 0, T0, refused=True, model="m")  # an engine's 4xx: used nothing
    cost = 30 * units(1000, "p") // 10**6 + 10 * units(100, "p") // 10**6 + 8 * units(
        2000, "p") // 10**6  # fmt: skip
    assert book.days.rows() == (DayRow("acme", "m", TODAY, 1, 40, 10, 8, cost),)
