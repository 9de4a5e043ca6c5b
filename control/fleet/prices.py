"""Prices changed at run time (`baton prices set|unset`), laid over the config file's
`[prices."MODEL"]` by the rule backends and tenants follow (control/fleet/db.py): the file
is the base; a price set at run time replaces the file's for its model; a model unset at run
time stays without a price even if the file has one, until it is set again. What is kept
(fleet.db, or etcd with replicas) is the difference, so a model later priced in the file
gets its price unless an operator changed that model at run time.

A price is kept as the decimal strings an operator wrote, per million tokens (what the wire
carries too, baton/wire_money.py): exact, and readable in the database."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping

from baton.pricing import PER_MILLION, Price, PriceTable, amount
from control.exceptions import ConfigError

# What fleet.db and etcd keep of one price: model, input, cached_input, output.
PriceRow = tuple[str, str, str, str]


def decimal(value_units: int) -> str:
    """Units a token as a decimal string per million tokens ("3", "0.15")."""
    text = format(amount(value_units * PER_MILLION), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def price_row(model: str, p: Price) -> PriceRow:
    return model, decimal(p.input), decimal(p.cached_input), decimal(p.output)


def price_from_row(model: str, input: str, cached_input: str, output: str) -> Price:
    """A saved row; anything that is not what price_row writes is refused (ConfigError)."""
    if not isinstance(model, str) or not model:
        raise ConfigError(f"a saved price is for a model name, not {model!r}")
    try:
        return Price.per_million(input, output, cached_input)
    except ValueError as exc:
        raise ConfigError(f"price of {model!r}: unreadable row ({exc})") from None


def price_overlay(
    config: PriceTable, current: PriceTable
) -> tuple[dict[str, Price], frozenset[str]]:
    """(set, unset): the difference between the config file's prices and the prices now."""
    base, now = config.prices, current.prices
    changed = {m: p for m, p in sorted(now.items()) if base.get(m) != p}
    return changed, frozenset(m for m in base if m not in now)


def laid_over(config: PriceTable, saved: Mapping[str, Price], unset: frozenset[str]) -> PriceTable:
    """The config's prices minus those unset at run time, plus (replacing by model) those
    set at run time."""
    out = {m: p for m, p in config.prices.items() if m not in unset}
    out.update(saved)
    return PriceTable(out)


def shadowed_prices(config: PriceTable, saved: Mapping[str, Price]) -> list[str]:
    """The models whose config file price one set at run time replaces (control says so)."""
    return sorted(m for m, p in config.prices.items() if m in saved and saved[m] != p)
