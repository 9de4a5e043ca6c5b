"""Budgets: how much a tenant may spend over a period (an amount per hour, day, ISO week or
calendar month, on the calendar of a time zone the operator names; baton/periods.py), and
the values the spend ledger (baton/spend.py) answers with: a budget's standing, a refusal at
a budget, and the rows persistence keeps. Amounts are integer units of money
(baton/pricing.py)."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from baton.periods import PERIODS, UTC, Calendar, zone
from baton.pricing import amount, money, units

BUDGET_FIELDS = ("amount", "period", "zone", "soft")


@dataclass(frozen=True, slots=True)
class Budget:
    """`amount` in units per period of `calendar`. `soft`: reported when reached, never
    refused."""

    amount: int
    calendar: Calendar
    soft: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.amount, bool) or not isinstance(self.amount, int) or self.amount < 0:
            raise ValueError(f"a budget's amount is a non-negative integer of units, "
                             f"not {self.amount!r}")  # fmt: skip

    @classmethod
    def of(
        cls, amount: object, period: object, zone_name: object = UTC, soft: object = False
    ) -> Budget:
        """From what an operator writes: an amount of currency, "day", "Europe/Berlin"."""
        if not isinstance(period, str):
            raise ValueError(f"unknown period {period!r}: one of {PERIODS}")
        if not isinstance(zone_name, str):
            raise ValueError(f"unknown time zone {zone_name!r}: an IANA name such as 'UTC'")
        if not isinstance(soft, bool):
            raise ValueError(f"soft is true or false, not {soft!r}")
        return cls(units(amount, "amount"), Calendar.of(period, zone_name), soft)

    @classmethod
    def parse(cls, text: str) -> Budget:
        """From the CLI's spelling: AMOUNT/PERIOD[@ZONE][:soft], e.g. 50/day,
        1000/month@Europe/Berlin, 40/week:soft. A ValueError says what is wrong."""
        spec, soft = text.strip(), False
        if spec.endswith(":soft"):
            spec, soft = spec[: -len(":soft")], True
        value, sep, rest = spec.partition("/")
        period_name, _, zone_name = rest.partition("@")
        if not sep or not value or not period_name:
            raise ValueError(f"a budget is AMOUNT/PERIOD[@ZONE][:soft] (50/day@UTC), "
                             f"not {text!r}")  # fmt: skip
        return cls.of(value.strip(), period_name.strip(), zone_name.strip() or UTC, soft)

    def text(self) -> str:
        """As Budget.parse reads it: 50/day@UTC, 40/week@Europe/Berlin:soft."""
        whole = format(amount(self.amount), "f")
        whole = whole.rstrip("0").rstrip(".") if "." in whole else whole
        soft = ":soft" if self.soft else ""
        return f"{whole}/{self.calendar.period.value}@{self.calendar.zone}{soft}"

    def describe(self) -> str:
        """As an operator reads it: "50.00 per day (UTC)", "soft 40.00 per week (UTC)"."""
        soft = "soft " if self.soft else ""
        return f"{soft}{money(self.amount)} per {self.calendar.period} ({self.calendar.zone})"


def parse_budgets(specs: Sequence[Mapping[str, object]]) -> tuple[Budget, ...]:
    """A tenant's budgets from config: [{amount = 50, period = "day"}, {amount = 1000, period
    = "month", zone = "Europe/Berlin", soft = true}]. A ValueError names the entry at fault."""
    out: list[Budget] = []
    for i, spec in enumerate(specs):
        where = f"budgets[{i}]"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where} must be a table of {', '.join(BUDGET_FIELDS)}")
        unknown = sorted(set(spec) - set(BUDGET_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} ({', '.join(BUDGET_FIELDS)})")
        for need in ("amount", "period"):
            if need not in spec:
                raise ValueError(f"{where}: {need} is missing")
        try:
            b = Budget.of(spec["amount"], spec["period"], spec.get("zone", UTC),
                          spec.get("soft", False))  # fmt: skip
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if b in out:
            raise ValueError(f"{where} repeats budgets[{out.index(b)}] ({b.describe()})")
        out.append(b)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Standing:
    """One budget of a tenant now. `limit`: the budget, or this shim's share of it; `spent`:
    settled; `in_flight`: the estimates of requests not ended yet."""

    tenant_id: str
    budget: Budget
    key: str
    limit: int
    spent: int
    in_flight: int
    start: int
    reset_at: int

    @property
    def remaining(self) -> int:
        return max(self.limit - self.spent - self.in_flight, 0)

    def reset_text(self) -> str:
        """The reset time on the budget's own wall clock (ISO 8601 with its offset)."""
        return datetime.fromtimestamp(self.reset_at, zone(self.budget.calendar.zone)).isoformat()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request refused at a hard budget: the one that will reset last, so a retry after
    `retry_after_s` is not refused by the same tenant's other budgets."""

    standing: Standing

    @property
    def detail(self) -> str:
        s = self.standing
        return (f"tenant {s.tenant_id!r} reached its budget of {s.budget.describe()}: "
                f"{money(s.spent + s.in_flight)} spent or in flight of {money(s.limit)}; "
                f"it resets at {s.reset_text()}")  # fmt: skip

    def retry_after_s(self, now: float) -> float:
        return max(self.standing.reset_at - now, 0.0)


@dataclass(frozen=True, slots=True)
class SpendRow:
    """What is stored per tenant and period: settled spend in units (Python ints; a store of
    64-bit integers holds 9.2 million currency units, so keep it as text) and the budget
    amounts already reported reached in the period."""

    tenant_id: str
    key: str
    start: int
    end: int
    spent: int
    notified: tuple[int, ...] = ()
