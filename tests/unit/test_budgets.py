"""baton/budgets.py and baton/spend.py: a tenant's budgets, what it spent, admission against
them, and the spend as persistence keeps it. Time is passed in: no clock, no sleeps."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from random import Random
from zoneinfo import ZoneInfo

import pytest

from baton.budgets import Budget, Refusal, SpendRow, parse_budgets
from baton.pricing import UNITS, PriceTable, units
from baton.spend import HOLD_TTL_S, SpendLedger

PRICES = PriceTable.parse({"m": {"input": 1, "output": 2}})  # per million tokens
DAY = Budget.of(1, "day")  # 1.00 a day, UTC
MONTH = Budget.of(5, "month", "Europe/Berlin")
DAY_AND_MONTH = (DAY, MONTH)


def u(amount: str | int | float) -> int:
    return units(amount, "amount")


def utc(*wall: int) -> float:
    return datetime(*wall, tzinfo=UTC).timestamp()  # type: ignore[arg-type, misc]


T0 = utc(2025, 3, 10, 12)  # a Monday noon


def spend(
    ledger: SpendLedger,
    rid: str,
    cost: str,
    now: float,
    budgets: tuple[Budget, ...] = DAY_AND_MONTH,
    tenant: str = "acme",
) -> Refusal | None:
    """One request admitted and ended at `now`, costing what it was estimated at."""
    refused = ledger.admit(rid, tenant, budgets, u(cost), now)
    if refused is None:
        ledger.finished(rid, u(cost), now)
    return refused


def spent(ledger: SpendLedger, budgets: tuple[Budget, ...], now: float,
          tenant: str = "acme") -> list[int]:  # fmt: skip
    return [s.spent for s in ledger.standing(tenant, budgets, now)]


# -- budgets as an operator writes them ---------------------------------------------------


def test_budgets_parse_with_utc_the_default_zone() -> None:
    budgets = parse_budgets([
        {"amount": 50, "period": "day"},
        {"amount": "1000", "period": "month", "zone": "Europe/Berlin", "soft": True},
    ])  # fmt: skip
    assert budgets[0] == Budget(50 * UNITS, budgets[0].calendar)
    assert budgets[0].calendar.zone == "UTC" and budgets[1].soft
    assert budgets[1].describe() == "soft 1000.00 per month (Europe/Berlin)"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"amount": -5, "period": "day"}, "budgets[0]: amount must not be negative"),
        ({"amount": "lots", "period": "day"}, "budgets[0]: amount must be a number"),
        ({"amount": float("inf"), "period": "day"}, "budgets[0]: amount must be finite"),
        ({"amount": 5, "period": "fortnight"}, "budgets[0]: unknown period 'fortnight'"),
        (
            {"amount": 5, "period": "day", "zone": "Mars/Olympus"},
            "budgets[0]: unknown time zone 'Mars/Olympus'",
        ),
        ({"amount": 5, "period": "day", "soft": "yes"}, "budgets[0]: soft is true or false"),
        ({"amount": 5}, "budgets[0]: period is missing"),
        ({"amount": 5, "period": "day", "limit": 3}, "budgets[0]: unknown field 'limit'"),
    ],
)
def test_bad_budgets_are_refused_naming_the_entry(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_budgets([spec])


def test_a_budget_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"budgets\[1\] repeats budgets\[0\]"):
        parse_budgets([{"amount": 5, "period": "day"}, {"amount": "5.0", "period": "day"}])


# -- admission ----------------------------------------------------------------------------


def test_a_tenant_without_budgets_is_admitted_and_not_counted() -> None:
    ledger = SpendLedger()
    assert ledger.admit("r1", "acme", (), u(100), T0) is None
    assert ledger.finished("r1", u(100), T0) is None
    assert ledger.unwritten() == ()


def test_several_budgets_at_once_the_one_that_resets_last_refuses() -> None:
    ledger = SpendLedger()
    for i in range(10):
        assert spend(ledger, f"a{i}", "0.1", T0) is None  # 1.00 today
    refused = ledger.admit("a10", "acme", DAY_AND_MONTH, u("0.1"), T0)
    assert refused is not None and refused.standing.budget == DAY
    assert refused.standing.reset_at == utc(2025, 3, 11)
    assert refused.retry_after_s(T0) == 12 * 3600
    assert refused.standing.limit == u(1) and refused.standing.spent == u(1)
    assert "reached its budget of 1.00 per day (UTC): 1.00 spent or in flight of 1.00" in (
        refused.detail)  # fmt: skip
    assert "resets at 2025-03-11T00:00:00+00:00" in refused.detail
    # Four more days of 1.00 reach the month's 5.00, which then refuses on a fresh day.
    for day in range(11, 15):
        assert spend(ledger, f"d{day}", "1", utc(2025, 3, day, 12)) is None
    refused = ledger.admit("x", "acme", DAY_AND_MONTH, u("0.1"), utc(2025, 3, 15, 12))
    assert refused is not None and refused.standing.budget == MONTH
    assert refused.standing.reset_at == datetime(2025, 4, 1, tzinfo=ZoneInfo("Europe/Berlin")
                                                 ).timestamp()  # fmt: skip
    assert "resets at 2025-04-01T00:00:00+02:00" in refused.detail  # Berlin's clock, in summer
    # The day's budget is reached too: the month resets later, so the month is named.
    ledger2 = SpendLedger()
    assert spend(ledger2, "big", "5", T0) is None
    refused = ledger2.admit("y", "acme", DAY_AND_MONTH, 1, T0)
    assert refused is not None and refused.standing.budget == MONTH


def test_a_request_is_refused_with_nothing_held() -> None:
    ledger = SpendLedger()
    assert spend(ledger, "r1", "1", T0) is None
    assert ledger.admit("r2", "acme", (DAY,), u("0.5"), T0) is not None
    assert [s.in_flight for s in ledger.standing("acme", (DAY,), T0)] == [0]
    assert ledger.finished("r2", u("0.5"), T0) is None  # never admitted: nothing to end


def test_concurrent_requests_overshoot_by_at_most_what_was_in_flight() -> None:
    rng = Random(0)
    ledger, budgets = SpendLedger(), (DAY,)
    in_flight: dict[str, int] = {}
    admitted = refused = 0
    for i in range(2000):
        if in_flight and rng.random() < 0.45:  # one ends, costing at most its estimate
            rid = rng.choice(sorted(in_flight))
            ledger.finished(rid, rng.randint(0, in_flight.pop(rid)), T0)
            continue
        estimate = u("0.001") * rng.randint(1, 30)  # up to 0.03 a request
        if ledger.admit(f"r{i}", "acme", budgets, estimate, T0) is None:
            in_flight[f"r{i}"] = estimate
            admitted += 1
        else:
            refused += 1
    for rid, estimate in in_flight.items():
        ledger.finished(rid, estimate, T0)
    total = spent(ledger, budgets, T0)[0]
    assert admitted > 50 and refused > 0
    assert u("0.95") < total <= u(1) + u("0.03")  # at most one estimate over the budget


def test_a_soft_budget_reports_once_a_period_and_never_refuses() -> None:
    soft = Budget.of("0.5", "day", soft=True)
    budgets = (soft, DAY)
    ledger = SpendLedger()
    reports = []
    for i in range(12):
        now = T0 + i
        if ledger.admit(f"r{i}", "acme", budgets, u("0.1"), now) is None:
            reports.append(ledger.finished(f"r{i}", u("0.1"), now))
    crossed = [c for r in reports for c in r or ()]
    assert [(c.budget, c.spent) for c in crossed] == [(soft, u("0.5")), (DAY, u(1))]
    assert len(reports) == 10  # the hard budget refused at 1.00; the soft one never did
    # The next day both report again, once.
    ledger.admit("n1", "acme", budgets, u("0.6"), utc(2025, 3, 11, 1))
    crossed2 = ledger.finished("n1", u("0.6"), utc(2025, 3, 11, 1))
    assert crossed2 is not None and [c.budget for c in crossed2] == [soft]
    assert crossed2[0].key == "day:UTC:2025-03-11"


def test_a_budget_changed_mid_period_keeps_the_spend() -> None:
    ledger = SpendLedger()
    assert spend(ledger, "r1", "1", T0, (DAY,)) is None
    assert ledger.admit("r2", "acme", (DAY,), 1, T0) is not None
    raised = (Budget.of(2, "day"),)  # the operator raises it: the 1.00 spent still counts
    assert ledger.admit("r2", "acme", raised, u("0.5"), T0) is None
    assert [s.spent + s.in_flight for s in ledger.standing("acme", raised, T0)] == [u("1.5")]


# -- the request's end --------------------------------------------------------------------


def test_the_end_replaces_the_estimate_by_the_engines_usage() -> None:
    ledger = SpendLedger()
    estimate = PRICES.estimate("m", 1000, 4000)  # the prompt, and max_tokens of output
    ledger.admit("r1", "acme", (DAY,), estimate, T0)
    assert [s.in_flight for s in ledger.standing("acme", (DAY,), T0)] == [estimate]
    actual = PRICES.cost("m", 1000, 200, 150)  # stopped early: what the engine counted
    assert ledger.finished("r1", actual, T0) == ()
    assert spent(ledger, (DAY,), T0) == [actual]
    assert [s.in_flight for s in ledger.standing("acme", (DAY,), T0)] == [0]


def test_a_failover_and_a_resume_are_charged_once() -> None:
    ledger = SpendLedger()
    assert ledger.admit("r1", "acme", (DAY,), u("0.2"), T0) is None
    assert ledger.admit("r1", "acme", (DAY,), u("0.2"), T0 + 1) is None  # asked again: held once
    assert ledger.finished("r1", u("0.3"), T0 + 5) == ()  # the whole generation, both backends
    assert ledger.finished("r1", u("0.3"), T0 + 6) is None  # its end reported twice
    assert ledger.finished("r1", u("0.3"), T0 + 6, tenant_id="acme", budgets=(DAY,)) is None
    assert spent(ledger, (DAY,), T0) == [u("0.3")]


def test_an_end_without_usage_keeps_the_estimate_and_a_cancel_costs_nothing() -> None:
    ledger = SpendLedger()
    ledger.admit("gone", "acme", (DAY,), u("0.4"), T0)
    ledger.finished("gone", None, T0)  # the client left: the engine's usage is unknown
    ledger.admit("nobackend", "acme", (DAY,), u("0.4"), T0)
    assert ledger.cancel("nobackend") == "acme"
    assert ledger.cancel("nobackend") is None
    ledger.admit("refused", "acme", (DAY,), u("0.4"), T0)
    ledger.finished("refused", 0, T0)  # the engine refused it (a 4xx): it generated nothing
    assert spent(ledger, (DAY,), T0) == [u("0.4")]


def test_a_request_admitted_elsewhere_is_charged_at_its_end_once() -> None:
    """Admitted by a shim while control was away, or by the leader before this one."""
    ledger = SpendLedger()
    assert ledger.finished("s1", u("0.25"), T0, tenant_id="acme", budgets=(DAY,)) == ()
    assert ledger.finished("s1", u("0.25"), T0, tenant_id="acme", budgets=(DAY,)) is None
    assert ledger.finished("s2", u("0.25"), T0) is None  # no tenant named: nothing to charge
    assert spent(ledger, (DAY,), T0) == [u("0.25")]


def test_a_request_whose_end_never_comes_is_charged_its_estimate() -> None:
    ledger = SpendLedger()
    ledger.admit("lost", "acme", (DAY, Budget.of("0.1", "day", soft=True)), u("0.3"), T0)
    crossed = ledger.expire(T0 + HOLD_TTL_S + 1)
    assert [c.budget.soft for c in crossed] == [True]
    assert spent(ledger, (DAY,), T0) == [u("0.3")]


# -- periods roll over ----------------------------------------------------------------------


def test_the_period_rolls_over_on_the_injected_clock() -> None:
    ledger = SpendLedger()
    before = utc(2025, 3, 10, 23, 59, 59)
    assert spend(ledger, "r1", "1", before, (DAY,)) is None
    assert ledger.admit("r2", "acme", (DAY,), 1, before) is not None
    assert ledger.admit("late", "acme", (DAY,), u("0.2"), before - 10) is not None
    midnight = utc(2025, 3, 11)
    assert ledger.admit("r3", "acme", (DAY,), u("0.2"), midnight) is None
    [today] = ledger.standing("acme", (DAY,), midnight)
    assert today.key == "day:UTC:2025-03-11" and today.spent == 0 and today.in_flight == u("0.2")
    assert today.reset_at == utc(2025, 3, 12)


def test_a_berlin_day_budget_resets_at_berlins_midnight_after_a_23_hour_day() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    day = (Budget.of(1, "day", "Europe/Berlin"),)
    ledger = SpendLedger()
    morning = datetime(2025, 3, 30, 0, 30, tzinfo=berlin).timestamp()  # the clocks go forward
    assert spend(ledger, "r1", "1", morning, day) is None
    refused = ledger.admit("r2", "acme", day, 1, morning)
    assert refused is not None
    midnight = datetime(2025, 3, 31, tzinfo=berlin).timestamp()
    assert refused.standing.reset_at == midnight == utc(2025, 3, 30, 22)
    assert refused.retry_after_s(morning) == 22.5 * 3600  # 23:30 on the wall clock
    assert ledger.admit("r2", "acme", day, 1, midnight - 1) is not None
    assert ledger.admit("r2", "acme", day, 1, midnight) is None
    [standing] = ledger.standing("acme", day, midnight)
    assert standing.remaining == u(1) - 1 and standing.key == "day:Europe/Berlin:2025-03-31"


def test_a_request_is_charged_to_the_period_it_was_admitted_in() -> None:
    ledger = SpendLedger()
    ledger.admit("r1", "acme", (DAY,), u("0.2"), utc(2025, 3, 10, 23, 59))
    ledger.finished("r1", u("0.3"), utc(2025, 3, 11, 0, 1))  # ended after midnight
    assert spent(ledger, (DAY,), utc(2025, 3, 11, 0, 2)) == [0]
    keys = {r.key: r.spent for r in ledger.unwritten()}
    assert keys == {"day:UTC:2025-03-10": u("0.3")}


# -- persistence ----------------------------------------------------------------------------


def test_restore_after_a_restart_equals_the_state_before() -> None:
    soft = Budget.of("0.5", "week", "America/New_York", soft=True)
    plans = {"acme": (DAY, MONTH, soft), "beta": (Budget.of(3, "hour"),)}
    before = SpendLedger()
    rng = Random(1)
    for i in range(300):
        tenant = rng.choice(sorted(plans))
        spend(before, f"r{i}", str(rng.randint(1, 40) / 1000), T0 + i * 30, plans[tenant], tenant)
    now = T0 + 300 * 30
    rows = before.unwritten()
    before.written(rows, now)
    assert before.unwritten() == () and before.unwritten_units == 0
    after = SpendLedger()
    after.restore(rows, now)
    for tenant, budgets in plans.items():
        assert after.standing(tenant, budgets, now) == before.standing(tenant, budgets, now)
    # The same next requests get the same answers, and a soft budget reported before the
    # restart is not reported again.
    for i in range(40):
        tenant = rng.choice(sorted(plans))
        a = spend(before, f"n{i}", "0.05", now + i, plans[tenant], tenant)
        b = spend(after, f"n{i}", "0.05", now + i, plans[tenant], tenant)
        assert (a is None) == (b is None)
    assert after.rows() == before.rows()


def test_unwritten_spend_stays_until_a_write_is_acknowledged() -> None:
    ledger = SpendLedger()
    spend(ledger, "r1", "0.2", T0, (DAY,))
    rows = ledger.unwritten()
    assert [(r.key, r.spent) for r in rows] == [("day:UTC:2025-03-10", u("0.2"))]
    assert ledger.unwritten_units == u("0.2")
    # The store is away (etcd down): nothing acknowledged, nothing lost.
    spend(ledger, "r2", "0.1", T0, (DAY,))
    assert ledger.unwritten()[0].spent == u("0.3")
    rows = ledger.unwritten()
    spend(ledger, "r3", "0.1", T0, (DAY,))  # changed while the write was under way
    ledger.written(rows, T0)
    assert [r.spent for r in ledger.unwritten()] == [u("0.4")]
    assert ledger.unwritten_units == u("0.1")
    ledger.written(ledger.unwritten(), T0)
    assert ledger.unwritten() == () and ledger.unwritten_units == 0


def test_spend_rows_are_whole_values_and_say_which_budgets_were_reported() -> None:
    soft = Budget.of("0.1", "day", soft=True)
    ledger = SpendLedger()
    spend(ledger, "r1", "0.2", T0, (soft, DAY))
    [row] = ledger.unwritten()
    assert row == SpendRow("acme", "day:UTC:2025-03-10", int(utc(2025, 3, 10)),
                           int(utc(2025, 3, 11)), u("0.2"), (u("0.1"),))  # fmt: skip


def test_memory_holds_the_current_periods_and_what_is_not_written() -> None:
    hourly = (Budget.of(1, "hour"), DAY)
    ledger = SpendLedger()
    for h in range(24 * 30):  # a month of hours, written every hour
        now = T0 + h * 3600
        spend(ledger, f"r{h}", "0.01", now, hourly)
        ledger.written(ledger.unwritten(), now)
    assert len(ledger.rows()) == 2  # this hour and this day
    # A request in flight across the end keeps its period until it ends and is written.
    ledger.admit("slow", "acme", hourly, u("0.01"), now)
    later = now + 3600
    ledger.written(ledger.unwritten(), later)
    spend(ledger, "next", "0.01", later, hourly)
    assert len(ledger.rows()) == 3  # the hour before, held; this hour; this day
    ledger.finished("slow", u("0.01"), later)
    ledger.written(ledger.unwritten(), later)
    assert len(ledger.rows()) == 2


def test_a_shims_ledger_drops_ended_periods_without_writing() -> None:
    ledger = SpendLedger(persisted=False)
    for h in range(100):
        spend(ledger, f"r{h}", "0.01", T0 + h * 3600, (Budget.of(1, "hour"),))
    assert ledger.unwritten() == () and len(ledger.rows()) == 1


def test_restore_leaves_out_periods_that_ended() -> None:
    ledger = SpendLedger()
    ledger.restore([SpendRow("acme", "day:UTC:2025-03-09", int(utc(2025, 3, 9)),
                             int(utc(2025, 3, 10)), u(1))], T0)  # fmt: skip
    assert ledger.rows() == ()


# -- a shim's share while control is away ---------------------------------------------------


def test_a_shim_enforces_its_share_of_what_was_left() -> None:
    shim = SpendLedger(persisted=False)
    start, end = int(utc(2025, 3, 10)), int(utc(2025, 3, 11))
    shim.restore([SpendRow("acme", "day:UTC:2025-03-10", start, end, u("0.6"))], T0)
    # 4 shims share the 0.40 left: this one may let the tenant reach 0.70.
    [standing] = shim.standing("acme", (DAY,), T0, share=4)
    assert standing.limit == u("0.7") and standing.spent == u("0.6")
    assert spend(shim, "r1", "0.05", T0, (DAY,)) is None
    assert shim.admit("r2", "acme", (DAY,), u("0.05"), T0, share=4) is None
    refused = shim.admit("r3", "acme", (DAY,), u("0.05"), T0, share=4)
    assert refused is not None and refused.standing.limit == u("0.7")
    # Without a word from control (nothing restored) a shim has its share of the whole.
    fresh = SpendLedger(persisted=False)
    assert fresh.standing("acme", (DAY,), T0, share=4)[0].limit == u("0.25")


# -- the micro-benchmark runs (its timings are not judged here) -----------------------------


def test_the_admission_benchmark_runs() -> None:
    from bench.budget_admission import measure, report

    figures = measure(decisions=50, reps=1)
    assert figures["route_us"] > 0 and figures["book+budgets_us"] > 0
    assert "budgets add" in report(figures)
