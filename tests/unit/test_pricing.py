"""baton/pricing.py: prices per model, a request's cost in exact integer units."""

from __future__ import annotations

from decimal import Decimal

import pytest

from baton.pricing import UNITS, Price, PriceTable, amount, money, units

TABLE = PriceTable.parse({
    "big": {"input": 3, "cached_input": "0.3", "output": 15},
    "small": {"input": 0.15, "output": 0.6},  # no cached price: cached tokens cost as input
})  # fmt: skip


def test_a_request_costs_its_uncached_cached_and_output_tokens_at_their_prices() -> None:
    # 800 uncached at 3/M, 200 cached at 0.30/M, 500 out at 15/M = 0.0024 + 0.00006 + 0.0075
    assert amount(TABLE.cost("big", 1000, 200, 500)) == Decimal("0.00996")
    assert amount(TABLE.cost("small", 1000, 200, 500)) == Decimal("0.00045")
    assert money(TABLE.cost("big", 1_000_000, 0, 0)) == "3.00"


def test_a_model_without_a_price_costs_nothing_and_says_so() -> None:
    assert TABLE.cost("unpriced", 10_000, 0, 10_000) == 0
    assert TABLE.estimate("unpriced", 10_000, 10_000) == 0
    assert not TABLE.priced("unpriced") and TABLE.price("unpriced") is None
    assert TABLE.priced("big")


def test_the_estimate_prices_the_whole_prompt_as_uncached_and_the_output_cap() -> None:
    assert TABLE.estimate("big", 1000, 500) == TABLE.cost("big", 1000, 0, 500)
    assert TABLE.estimate("big", 1000, 500) >= TABLE.cost("big", 1000, 1000, 500)


def test_costs_add_up_exactly_over_millions_of_requests() -> None:
    # 0.0000375 a request: a float sum of it drifts; the integer units do not.
    price = Price.per_million(input="0.0375", output=0)
    per_request = price.cost(1000, 0, 0)
    assert amount(per_request) == Decimal("0.0000375")
    total, floats = 0, 0.0
    for _ in range(2_000_000):
        total += per_request
        floats += 0.0000375
    assert amount(total) == Decimal("75")
    assert floats != 75.0  # what the integers avoid


def test_prices_keep_what_the_operator_wrote() -> None:
    p = Price.per_million(input="2.5", output=10, cached_input=1.25)
    assert p.per_million_tokens() == {"input": Decimal("2.5"), "cached_input": Decimal("1.25"),
                                      "output": Decimal("10")}  # fmt: skip
    assert p.input == 2_500_000  # units per token: 2.5 per million = 2.5e-6 * 1e12
    assert units("0.000001", "x") == UNITS // 10**6
    assert units(50, "x") == 50 * UNITS


def test_usage_from_an_engine_is_clamped_to_sense() -> None:
    p = TABLE.price("big")
    assert p is not None
    assert p.cost(100, 500, 0) == p.cost(100, 100, 0)  # cached is part of the prompt
    assert p.cost(-5, -1, -7) == 0


def test_money_reads_as_an_operator_writes_it() -> None:
    assert money(50 * UNITS) == "50.00"
    assert money(units("0.00015", "x")) == "0.00015"
    assert money(0) == "0.00"
    assert money(1) == "0.000000000001"


def test_a_table_changes_by_model() -> None:
    t = TABLE.with_price("new", Price.per_million(1, 2))
    assert t.priced("new") and not TABLE.priced("new")
    assert not t.with_price("new", None).priced("new")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"m": {"input": -1, "output": 1}}, "price of 'm': input must not be negative"),
        ({"m": {"input": 1, "output": float("nan")}}, "price of 'm': output must be finite"),
        ({"m": {"input": float("inf"), "output": 1}}, "price of 'm': input must be finite"),
        (
            {"m": {"input": 1, "output": 1, "cached_input": "-0.1"}},
            "price of 'm': cached_input must not be negative",
        ),
        ({"m": {"input": "1.0000001", "output": 1}}, "input has more than 6 decimals"),
        ({"m": {"input": "cheap", "output": 1}}, "input must be a number, not 'cheap'"),
        ({"m": {"input": True, "output": 1}}, "input must be a number, not True"),
        ({"m": {"input": 1e13, "output": 1}}, "input must be at most"),
        ({"m": {"output": 1}}, "price of 'm': input is missing"),
        ({"m": {"input": 1, "output": 1, "outptu": 2}}, "price of 'm': unknown field 'outptu'"),
        ({"m": 3}, "price of 'm' must be a table"),
        ({"": {"input": 1, "output": 1}}, "a price is for a model name"),
    ],
)
def test_bad_prices_are_refused_naming_the_model_and_field(table: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PriceTable.parse(table)  # type: ignore[arg-type]


def test_a_price_in_units_is_checked_too() -> None:
    with pytest.raises(ValueError, match="output must be a non-negative integer"):
        Price(1, 1, -1)
