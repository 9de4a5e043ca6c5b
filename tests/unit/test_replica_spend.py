"""Tenants' spend with control replicas (issue 43): the leader's spend on a follower, from the
soft-state ops and from the dump a late follower gets (control/fleet/journal.py), and the
rows as etcd keeps them (control/replicas/spend.py)."""

from __future__ import annotations

import msgspec
import pytest

from baton.budgets import Budget, SpendRow
from baton.pricing import PriceTable
from baton.tenancy import Tenant
from control.fleet.journal import Op, dump, replay
from control.fleet.registry import Registry
from control.replicas.spend import batches, decode_row, encode_row, spend_key, to_restore
from tests.factories import registry

PRICES = PriceTable.parse({"toy": {"input": 1000, "output": 2000}})
NOW = 1_750_000_000.0
HUGE = 3 * 2**70  # units: past 64 bits, as a big fleet's month can be


def _pair() -> tuple[Registry, Registry, list[Op]]:
    leader, follower = registry(("a",)), registry(("a",))
    for reg in (leader, follower):
        reg.tenants.prices = PRICES
        reg.tenants.replace([Tenant("acme", budgets=(Budget.parse("5/day"),
                                                     Budget.parse("90/month")))])  # fmt: skip
    ops: list[Op] = []
    leader.journal_to(ops.append)
    return leader, follower, ops


def _carried(ops: list[Op]) -> list[Op]:
    return [msgspec.msgpack.decode(msgspec.msgpack.encode(op)) for op in ops]


def _spent(reg: Registry) -> list[tuple[str, str, int]]:
    return [(r.tenant_id, r.key, r.spent) for r in reg.tenants.spend.rows()]


def test_the_followers_spend_is_the_leaders_from_the_ops() -> None:
    leader, follower, ops = _pair()
    for i in range(4):
        assert leader.tenants.admit(f"r{i}", "acme", "toy", 30, NOW, 10).refused is None
        leader.tenants.finished(f"r{i}", 20, 7, NOW + 1, model="toy", tenant_id="acme")
    leader.tenants.admit("in-flight", "acme", "toy", 30, NOW + 2, 10)
    for op in _carried(ops):
        replay(follower, op)
    assert _spent(follower) == _spent(leader) and _spent(leader)[0][2] > 0
    # The request in flight at the takeover ends on the follower, now leading: charged once.
    for reg in (leader, follower):
        reg.tenants.finished("in-flight", 20, 7, NOW + 3, model="toy", tenant_id="acme")
        reg.tenants.finished("in-flight", 20, 7, NOW + 3, model="toy", tenant_id="acme")
    assert _spent(follower) == _spent(leader)


def test_a_late_follower_gets_the_spend_from_the_dump_even_past_64_bits() -> None:
    leader, follower, _ = _pair()
    leader.tenants.spend.restore(
        [SpendRow("acme", "day:UTC:2025-06-15", int(NOW) - 100, int(NOW) + 100, HUGE, (5,))],
        NOW,
    )
    leader.tenants.admit("r1", "acme", "toy", 30, NOW, 10)
    leader.tenants.finished("r1", 20, 7, NOW, model="toy", tenant_id="acme")
    for op in _carried(list(dump(leader))):
        assert replay(follower, op)
    assert follower.tenants.spend.rows() == leader.tenants.spend.rows()
    assert any(r.spent > HUGE for r in follower.tenants.spend.rows())


ROW = SpendRow("acme", "day:Europe/Berlin:2025-06-15+02:00", 1_749_938_400, 1_750_024_800,
               HUGE, (5 * 10**12, HUGE))  # fmt: skip


def test_a_row_goes_to_etcd_and_back_whole() -> None:
    assert decode_row(encode_row(ROW)) == ROW
    # Its period's end leads the key: the periods not over yet are one range.
    assert spend_key(b"/baton/spend/", ROW) == (
        b"/baton/spend/001750024800/acme/day:Europe/Berlin:2025-06-15+02:00"
    )


@pytest.mark.parametrize("raw", [b"", b"{}", b'{"tenant": "a"}', b"[1, 2]",
                                 b'{"tenant": "a", "period": "p", "start": 1, "end": 2, '
                                 b'"spent": "x", "notified": []}'])  # fmt: skip
def test_an_unreadable_row_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_row(raw)


def _row(tenant: str, spent: int) -> SpendRow:
    return SpendRow(tenant, "k", 0, 10, spent)


@pytest.mark.parametrize(
    ("stored", "held", "taken"),
    [
        ([_row("a", 5)], [], [_row("a", 5)]),  # a replica that held nothing: all of etcd
        ([_row("a", 5)], [_row("a", 7)], []),  # the stream brought more than etcd had
        ([_row("a", 9)], [_row("a", 7)], [_row("a", 9)]),  # etcd has more: taken
        ([_row("a", 5), _row("b", 1)], [_row("a", 5)], [_row("b", 1)]),
        ([_row("a", 0)], [], [_row("a", 0)]),
    ],
)
def test_what_is_restored_from_etcd_is_what_the_ledger_holds_less_of(
    stored: list[SpendRow], held: list[SpendRow], taken: list[SpendRow]
) -> None:
    assert to_restore(stored, held) == taken


def test_rows_go_in_transactions_etcd_takes() -> None:
    rows = [_row(str(i), i) for i in range(250)]
    assert [len(b) for b in batches(rows)] == [100, 100, 50]
    assert batches([]) == []
