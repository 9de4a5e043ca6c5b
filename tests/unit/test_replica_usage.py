"""Use per tenant, model and UTC day in etcd with control replicas (issue 43): the rows as
etcd keeps them, their keys in (day, tenant, model) order, and the writer's flushes, restores
and reads (control/replicas/usage.py) over a dict standing in for etcd."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from baton.usage_days import DayRow, UsageDays, day_of, merge
from control.exceptions import StoreUnavailable
from control.replicas.etcd import EtcdUnavailable, KeyValue
from control.replicas.usage import (
    DaysWriter,
    day_key,
    day_range,
    decode_day,
    encode_day,
    to_restore,
)

NOW = 1_750_000_000.0
TODAY = day_of(NOW)
HUGE = 3 * 2**70  # units: past 64 bits
P = b"/baton/usage/"
LEADER = b"/baton/leader"


def _row(tenant: str = "acme", model: str = "toy", day: str = TODAY, n: int = 1) -> DayRow:
    return DayRow(tenant, model, day, n, 10 * n, n, 5 * n, 1000 * n)


def test_a_row_goes_to_etcd_and_back_whole() -> None:
    row = DayRow("acme", "meta-llama/Llama-3-8B", TODAY, 3, 100, 20, 50, HUGE)
    assert decode_day(encode_day(row)) == row
    assert day_key(P, row.key) == f"/baton/usage/{TODAY}/acme\0meta-llama/Llama-3-8B".encode()


@pytest.mark.parametrize("raw", [b"", b"{}", b"[1]", b'{"tenant": "a", "model": "m", "day": '
                                 b'"d", "requests": 1, "prompt": 1, "cached": 0, "completion": '
                                 b'1, "cost": "x"}'])  # fmt: skip
def test_an_unreadable_row_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_day(raw)


def test_keys_sort_as_the_rows_do() -> None:
    # "-" and "." sort before "/": a "/" after the tenant would put "team-a" before "team".
    keys = [(d, t, m) for d in ("2025-06-14", "2025-06-15")
            for t in ("team", "team-a", "team.b", "team/c", "teamz")
            for m in ("m", "m-1", "m/x")]  # fmt: skip
    assert sorted(keys, key=lambda k: day_key(P, k)) == sorted(keys)


def test_a_range_is_the_days_asked_past_the_page_token() -> None:
    start, end = day_range(P, "2025-06-14", "2025-06-15", None)
    inside = [day_key(P, ("2025-06-14", "a", "m")), day_key(P, ("2025-06-15", "zz", "zz"))]
    outside = [day_key(P, ("2025-06-13", "z", "m")), day_key(P, ("2025-06-16", "a", "m"))]
    assert all(start <= k < end for k in inside)
    assert not any(start <= k < end for k in outside)
    after = ("2025-06-14", "team", "m")
    start, _ = day_range(P, "2025-06-14", "2025-06-15", after)
    assert day_key(P, after) < start <= day_key(P, ("2025-06-14", "team", "m\0"))


@pytest.mark.parametrize(
    ("stored", "held", "taken"),
    [
        ([_row(n=5)], [], [_row(n=5)]),  # a replica that held nothing: all of etcd
        ([_row(n=5)], [_row(n=7)], []),  # the stream brought more than etcd had
        ([_row(n=9)], [_row(n=7)], [_row(n=9)]),
        ([_row(n=5), _row("b")], [_row(n=5)], [_row("b")]),
    ],
)
def test_what_is_restored_is_what_the_book_holds_fewer_requests_of(
    stored: list[DayRow], held: list[DayRow], taken: list[DayRow]
) -> None:
    assert to_restore(stored, held) == taken


class FakeEtcd:
    """Keys in a dict; a transaction's compare is on the leader key's create revision."""

    def __init__(self) -> None:
        self.kv: dict[bytes, bytes] = {}
        self.leader_revision = 7
        self.txns: list[int] = []
        self.down = False

    async def get_range(self, key: bytes, range_end: bytes, limit: int = 0) -> list[KeyValue]:
        if self.down:
            raise EtcdUnavailable("down")
        keys = sorted(k for k in self.kv if key <= k < range_end)[: limit or None]
        return [KeyValue(k, self.kv[k], 1, 1, 0) for k in keys]

    async def txn(self, compare: list[Any], success: list[Any]) -> tuple[bool, None]:
        if self.down:
            raise EtcdUnavailable("down")
        assert len(compare) + len(success) <= 128  # etcd's limit
        if compare[0].create_revision != self.leader_revision:
            return False, None
        self.txns.append(len(success))
        for op in success:
            self.kv[op.request_put.key] = op.request_put.value
        return True, None


def _writer(days: UsageDays, store: FakeEtcd, term: list[int]) -> DaysWriter:
    return DaysWriter(days, store, b"/baton", LEADER, lambda: term[0],  # type: ignore[arg-type]
                      lambda: NOW)  # fmt: skip


def _add(days: UsageDays, rid: str, tenant: str = "acme", model: str = "toy") -> None:
    days.add(rid, tenant, model, 10, 1, 5, 1000, NOW)


def test_the_leader_writes_what_changed_in_batches_and_a_follower_writes_nothing() -> None:
    store, term, days = FakeEtcd(), [0], UsageDays()
    writer = _writer(days, store, term)
    for i in range(250):
        _add(days, f"r{i}", tenant=f"t{i:03d}")
    assert asyncio.run(writer.flush()) == 0 and store.kv == {} and days.unwritten() == ()
    term[0] = 7  # elected: the first write is every row held
    assert asyncio.run(writer.flush()) == 250 and store.txns == [100, 100, 50]
    _add(days, "again", tenant="t001")
    assert asyncio.run(writer.flush()) == 1 and days.unwritten() == ()
    stored = asyncio.run(writer.stored_days("0000", TODAY, None, 0))
    assert stored == list(days.rows()) and stored[1].requests == 2
    # Paged as fleet.db is: in (day, tenant, model) order, past the token.
    page = asyncio.run(writer.stored_days(TODAY, TODAY, stored[99].key, 10))
    assert page == stored[100:110]


def test_a_deposed_leader_acknowledges_nothing_and_etcd_down_keeps_it_unwritten() -> None:
    store, term, days = FakeEtcd(), [3], UsageDays()
    writer = _writer(days, store, term)
    _add(days, "r1")
    assert asyncio.run(writer.flush()) == 0 and len(days.unwritten()) == 1  # term 3 is over
    term[0] = 7
    store.down = True
    with pytest.raises(EtcdUnavailable):
        asyncio.run(writer.flush())
    assert len(days.unwritten()) == 1
    with pytest.raises(StoreUnavailable):
        asyncio.run(writer.stored_days("0000", TODAY, None, 10))
    store.down = False
    assert asyncio.run(writer.flush()) == 1 and days.unwritten() == ()


def test_a_restart_counts_on_from_todays_rows_and_an_export_has_the_older_ones() -> None:
    store, days = FakeEtcd(), UsageDays()
    older = _row(day="2025-06-01", n=4)
    store.kv[day_key(b"/baton/usage/", older.key)] = encode_day(older)
    store.kv[day_key(b"/baton/usage/", _row(n=9).key)] = encode_day(_row(n=9))
    writer = _writer(days, store, [7])
    assert asyncio.run(writer.restore()) == 1
    _add(days, "r1")
    (row,) = days.rows()
    assert row.requests == 10 and row.cost == 9000 + 1000
    stored = asyncio.run(writer.stored_days("0000", TODAY, None, 10))
    assert merge(stored, days.rows()) == [older, row]
    # Elected with more from the stream than etcd has: kept as it is.
    assert asyncio.run(writer.restore()) == 0 and days.rows() == (row,)
