"""Prices and budgets across the wire (baton/wire.py's part for money, kept apart so the border
stays readable). Money travels as decimal strings of currency units: exact both ways, where a
double is not (0.15 per million tokens is not a binary fraction)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from baton.budgets import Budget, Standing
from baton.periods import UTC
from baton.pricing import PER_MILLION, Price, PriceTable, amount
from baton.v1 import admin_pb2, fleet_pb2

log = logging.getLogger("baton.wire")


def decimal(value_units: int) -> str:
    """Units as an exact decimal string of currency ("50", "0.000150")."""
    text = format(amount(value_units), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def budget_to_pb(b: Budget) -> fleet_pb2.Budget:
    cal = b.calendar
    return fleet_pb2.Budget(amount=decimal(b.amount), period=cal.period.value, zone=cal.zone,
                            soft=b.soft)  # fmt: skip


def budget_from_pb(b: fleet_pb2.Budget) -> Budget:
    """A ValueError naming what is wrong (an unknown period or zone, a bad amount)."""
    return Budget.of(b.amount, b.period, b.zone or UTC, b.soft)


def budgets_from_pb(budgets: Iterable[fleet_pb2.Budget], tenant_id: str) -> tuple[Budget, ...]:
    """A tenant's budgets as a snapshot brings them to a shim: one this side cannot read (a
    zone its tz database lacks) is left out and said, never a reason to drop the snapshot."""
    out = []
    for b in budgets:
        try:
            out.append(budget_from_pb(b))
        except ValueError as exc:
            log.warning("tenant %s: budget not enforced here: %s", tenant_id, exc)
    return tuple(out)


def prices_to_pb(table: PriceTable) -> dict[str, fleet_pb2.Price]:
    return {
        model: fleet_pb2.Price(
            input=decimal(p.input * PER_MILLION),
            cached_input=decimal(p.cached_input * PER_MILLION),
            output=decimal(p.output * PER_MILLION),
        )
        for model, p in table.prices.items()
    }


def prices_from_pb(prices: Mapping[str, fleet_pb2.Price]) -> PriceTable:
    """Control checked these: one that does not read is left out (said), not fatal."""
    out: dict[str, Price] = {}
    for model, p in prices.items():
        try:
            out[model] = Price.per_million(p.input, p.output, p.cached_input or None)
        except ValueError as exc:
            log.warning("price of %s not used here: %s", model, exc)
    return PriceTable(out)


def standing_to_pb(s: Standing) -> admin_pb2.BudgetStanding:
    pb = admin_pb2.BudgetStanding(
        budget=budget_to_pb(s.budget),
        spent=decimal(s.spent),
        in_flight=decimal(s.in_flight),
        remaining=decimal(s.remaining),
    )
    pb.period_start.FromSeconds(s.start)
    pb.reset.FromSeconds(s.reset_at)
    return pb
