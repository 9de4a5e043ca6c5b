"""Prices changed at run time (issue 43): the overlay kept over the config file's prices
(control/fleet/prices.py), by the tenants' rule: set at run time replaces the file's, unset
stays unset even if the file has it; kept exactly in fleet.db and etcd's JSON, brought to a
replica's registry by reconcile, and an operator's bad price refused naming its field."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from baton.pricing import Price, PriceTable
from baton.v1 import fleet_pb2
from control.api.admin_prices import price_from_pb
from control.exceptions import ConfigError
from control.fleet.db import Configured, FleetDB, configured, prices
from control.pairs.flow import PairFlow
from control.replicas import store
from control.replicas.reconcile import reconcile
from tests.factories import registry

P1 = Price.per_million(3, 15, "0.3")
P2 = Price.per_million("0.15", "0.6")
P3 = Price.per_million("0.000001", "999999.999999")
FILE = PriceTable({"a": P1, "b": P2})


def saved(current: PriceTable, config: PriceTable = FILE) -> Configured:
    return configured((), (), {}, (), config_prices=config, current_prices=current)


@pytest.mark.parametrize(
    ("current", "kept", "unset"),
    [
        (FILE, {}, set()),  # nothing changed: nothing kept
        (FILE.with_price("a", P3), {"a": P3}, set()),  # the file's replaced
        (FILE.with_price("c", P3), {"c": P3}, set()),  # one the file lacks
        (FILE.with_price("b", None), {}, {"b"}),  # the file's unset
        (PriceTable({"c": P1}), {"c": P1}, {"a", "b"}),
    ],
)
def test_the_overlay_is_the_difference_and_laid_over_the_file_gives_the_prices_now(
    current: PriceTable, kept: dict[str, Price], unset: set[str]
) -> None:
    s = saved(current)
    assert dict(s.prices) == kept and s.prices_unset == unset
    assert prices(FILE, s) == current


def test_the_file_changed_later_run_time_changes_still_win() -> None:
    s = saved(FILE.with_price("a", P3).with_price("b", None))
    later = PriceTable({"a": P2, "b": P1, "new": P3})  # the operator edited the file
    assert prices(later, s) == PriceTable({"a": P3, "new": P3})  # b stays unset


def test_fleet_db_keeps_prices_exactly_across_connections(tmp_path: Path) -> None:
    s = saved(FILE.with_price("a", P3).with_price("b", None).with_price("lora-x", P2))
    db = FleetDB(tmp_path / "fleet.db")
    db.save(s)
    db.close()
    again = FleetDB(tmp_path / "fleet.db").load()
    assert again.prices == s.prices and again.prices_unset == {"b"}
    assert again.prices["a"].per_million_tokens()["output"] == Decimal("999999.999999")


def test_a_bad_saved_price_is_refused_not_ignored(tmp_path: Path) -> None:
    db = FleetDB(tmp_path / "fleet.db")
    db._db.execute("INSERT INTO prices VALUES ('m', '-1', '0', '1')")
    with pytest.raises(ConfigError, match="price of 'm'.*negative"):
        db.load()


def test_etcd_keeps_them_and_reads_what_an_older_baton_wrote() -> None:
    s = saved(FILE.with_price("a", P3).with_price("b", None))
    back = store.decode(store.encode(s))
    assert back.prices == s.prices and back.prices_unset == {"b"}
    old = store.encode(Configured()).replace(b',"prices":[],"prices_unset":[]', b"")
    assert b"prices" not in old
    assert store.decode(old) == Configured()


def test_reconcile_brings_a_replicas_prices_to_the_store_and_back() -> None:
    reg = registry(["s0"])
    before = reg.snapshot.version
    reconcile(reg, PairFlow(reg), saved(FILE.with_price("a", P3)), config_prices=FILE)
    assert reg.tenants.prices == FILE.with_price("a", P3)
    assert reg.snapshot.prices == FILE.with_price("a", P3)  # shims get it in the snapshot
    assert reg.snapshot.version > before
    reconcile(reg, PairFlow(reg), Configured(), config_prices=FILE)  # a write undone
    assert reg.snapshot.prices == FILE


def pb(input: str = "3", output: str = "15", cached_input: str = "") -> fleet_pb2.Price:
    return fleet_pb2.Price(input=input, output=output, cached_input=cached_input)


@pytest.mark.parametrize(
    ("model", "price", "said"),
    [
        ("", pb(), "model"),
        (" m", pb(), "model"),
        ("m", pb(input="-1"), "input must not be negative"),
        ("m", pb(output="nan"), "output must be finite"),
        ("m", pb(cached_input="Infinity"), "cached_input must be finite"),
        ("m", pb(input="0.0000001"), "input has more than 6 decimals"),
        ("m", pb(output=""), "output: a price per million tokens is required"),
        ("m", pb(input="three"), "input must be a number"),
    ],
)
def test_an_operators_bad_price_is_refused_naming_the_field(
    model: str, price: fleet_pb2.Price, said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        price_from_pb(model, price)


def test_an_operators_price_is_exact_and_cached_input_defaults_to_input() -> None:
    assert price_from_pb("m", pb("0.15", "0.6")) == P2
    assert price_from_pb("m", pb("3", "15", "0.3")) == P1
