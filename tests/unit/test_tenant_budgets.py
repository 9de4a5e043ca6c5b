"""Budgets in control's tenant book (control/fleet/tenants.py), on an injected clock: the
estimate held at admission, the engine's usage settled at the end, a period that rolls over
at its zone's midnight, soft budgets that only say so, and refusals that charge nothing."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

from baton.budgets import Budget
from baton.model import Reason
from baton.pricing import UNITS, PriceTable
from baton.tenancy import Limited, Limits, Tenant
from control.fleet.tenants import TenantBook

PRICES = PriceTable.parse({"toy": {"input": 1000, "output": 2000, "cached_input": 100}})
ONE_TOKEN_IN, ONE_TOKEN_OUT = UNITS // 1000, 2 * UNITS // 1000  # 0.001 and 0.002


def at(text: str, zone: str = "UTC") -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone)).timestamp()


def book(*budgets: str, limits: Limits | None = None) -> TenantBook:
    tenant = Tenant("acme", limits=limits or Limits(),
                    budgets=tuple(Budget.parse(b) for b in budgets))  # fmt: skip
    return TenantBook([tenant], prices=PRICES)


def spend_until_refused(b: TenantBook, now: float, prefix: str) -> int:
    """Requests of 10 prompt and 10 output tokens (0.03 each), admitted and ended one at a
    time until one is refused; how many got through."""
    for i in range(1000):
        rid = f"{prefix}{i}"
        if b.admit(rid, "acme", "toy", 20, now, 10).refused is not None:
            return i
        b.finished(rid, 10, 10, now, model="toy")
    raise AssertionError("never refused")


def test_the_day_rolls_over_at_midnight_and_the_refusal_says_when() -> None:
    b = book("0.30/day")
    late = at("2027-03-01T23:59:00")
    assert spend_until_refused(b, late, "a") == 10  # 10 x 0.03 is the budget, exactly
    refused = b.admit("x", "acme", "toy", 20, late, 10)
    assert refused.refused is Reason.TENANT_BUDGET and refused.limited is Limited.BUDGET
    assert refused.quota is not None
    assert refused.quota.reset_at == at("2027-03-02T00:00:00")
    assert refused.quota.retry_after_s == 60.0
    assert "0.30 per day (UTC)" in refused.detail and "2027-03-02T00:00:00+00:00" in refused.detail
    # A second after midnight the day is new: the whole budget again.
    assert spend_until_refused(b, at("2027-03-02T00:00:01"), "b") == 10
    (standing,) = b.standing("acme", at("2027-03-02T12:00:00"))
    assert standing.spent == 10 * (10 * ONE_TOKEN_IN + 10 * ONE_TOKEN_OUT)  # the new day's


def test_a_berlin_month_resets_at_berlin_midnight() -> None:
    b = book("0.06/month@Europe/Berlin")
    # 23:30 UTC on 31 March is already 1 April in Berlin (UTC+2): a new month there.
    assert spend_until_refused(b, at("2027-03-31T21:00:00"), "a") == 2
    assert spend_until_refused(b, at("2027-03-31T23:30:00"), "b") == 2
    refused = b.admit("x", "acme", "toy", 20, at("2027-04-10T00:00:00"), 10)
    assert refused.quota is not None
    assert refused.quota.reset_at == at("2027-05-01T00:00:00", "Europe/Berlin")


def test_the_estimate_is_held_while_in_flight_and_the_usage_settles_it() -> None:
    b = book("1/day")
    now = at("2027-03-01T12:00:00")
    assert b.admit("r", "acme", "toy", 100, now, 60).refused is None  # 40 in, 60 out
    (s,) = b.standing("acme", now)
    assert s.in_flight == 40 * ONE_TOKEN_IN + 60 * ONE_TOKEN_OUT and s.spent == 0
    # The engine says 40 prompt tokens, 30 of them cached (at 100 per million), 5 out.
    b.finished("r", 40, 5, now, model="toy", cached_tokens=30)
    b.finished("r", 40, 5, now, model="toy", cached_tokens=30)  # a second report: once
    (s,) = b.standing("acme", now)
    assert s.in_flight == 0
    assert s.spent == 10 * ONE_TOKEN_IN + 30 * ONE_TOKEN_IN // 10 + 5 * ONE_TOKEN_OUT
    (u,) = b.usage(now=now)
    assert u.cost == s.spent and u.budgets == (s,)


def test_refusals_and_unserved_requests_cost_nothing() -> None:
    b = book("1/day", limits=Limits(concurrent=1))
    now = at("2027-03-01T12:00:00")
    assert b.admit("r1", "acme", "toy", 20, now, 10).refused is None
    # Refused by its concurrency: the budget's hold is let go again.
    assert b.admit("r2", "acme", "toy", 20, now, 10).refused is Reason.TENANT_LIMITED
    b.cancel("r1")  # no backend took it
    assert b.admit("r3", "acme", "toy", 20, now, 10).refused is None
    b.finished("r3", 0, 0, now, model="toy", served=False)  # its client left before a route
    assert b.admit("r4", "acme", "toy", 20, now, 10).refused is None
    b.finished("r4", 10, 10, now, model="toy", refused=True)  # the engine's 4xx
    (s,) = b.standing("acme", now)
    assert (s.spent, s.in_flight) == (0, 0)


def test_a_soft_budget_says_so_once_and_never_refuses() -> None:
    b = book("0.06/day:soft")
    now = at("2027-03-01T12:00:00")
    reached = []
    for i in range(5):
        assert b.admit(f"r{i}", "acme", "toy", 20, now, 10).refused is None
        reached += list(b.finished(f"r{i}", 10, 10, now, model="toy"))
    (s,) = reached
    assert s.budget.soft and s.spent == 2 * 30 * UNITS // 1000
    assert b.reached == {("acme", "day", True): 1}


def test_a_model_without_a_price_costs_nothing() -> None:
    b = book("0.01/day")
    now = at("2027-03-01T12:00:00")
    for i in range(20):
        assert b.admit(f"r{i}", "acme", "free", 20, now, 10).refused is None
        b.finished(f"r{i}", 100, 100, now, model="free")
    assert [s.spent for s in b.standing("acme", now)] == [0]


def test_a_request_a_shim_admitted_while_control_was_away_is_charged_at_its_end() -> None:
    b = book("1/day")
    now = at("2027-03-01T12:00:00")
    b.finished("degraded", 10, 10, now, model="toy", tenant_id="acme")
    b.finished("degraded", 10, 10, now, model="toy", tenant_id="acme")  # reported twice
    assert [s.spent for s in b.standing("acme", now)] == [30 * UNITS // 1000]
