"""LoRA adapter residency (control.fleet.adapters): what an operator would notice of it:
one load per adapter per backend at a time, LRU unloads that respect capacity and spare busy
adapters, a restarted engine's list winning over Baton's belief, and demand that decays."""

from __future__ import annotations

import math

import pytest

from baton.model import Adapter
from control.fleet.adapters import Demand, Drift, Residency


def full(capacity: int = 2, *names: str) -> Residency:
    res = Residency()
    res.set_capacity("a", capacity)
    for t, name in enumerate(names):
        res.touch("a", name, float(t))
    return res


def test_spec_is_a_frozen_value() -> None:
    spec = Adapter("sql-lora", "llama-3-8b", "/adapters/sql")
    assert spec == Adapter("sql-lora", "llama-3-8b", "/adapters/sql")
    with pytest.raises(AttributeError):
        spec.name = "x"  # type: ignore[misc]


def test_a_load_is_single_flight_per_backend_and_adapter() -> None:
    res = Residency()
    assert res.begin_load("a", "x")
    assert not res.begin_load("a", "x")  # the second request waits for the first load
    assert res.begin_load("b", "x")  # another backend loads independently
    assert res.loads_in_flight() == (("a", "x"), ("b", "x"))
    res.end_load("a", "x", True, now=5.0)
    assert res.holds("a", "x") and res.holders("x") == ("a",)
    assert res.loads_in_flight() == (("b", "x"),)


def test_a_failed_load_holds_nothing_and_can_be_retried() -> None:
    res = Residency()
    assert res.begin_load("a", "x")
    res.end_load("a", "x", False, now=1.0)
    assert not res.holds("a", "x") and res.loads_in_flight() == ()
    assert res.begin_load("a", "x")


def test_victims_are_least_recently_used_and_only_as_many_as_capacity_needs() -> None:
    res = full(2, "x", "y")
    assert res.held("a") == ("x", "y")
    assert res.victims("a", now=10.0) == ("x",)
    res.touch("a", "x", 11.0)  # x is used again: y becomes the oldest
    assert res.victims("a", now=12.0) == ("y",)
    assert res.victims("a", room_for=2, now=12.0) == ("y", "x")
    assert full(3, "x", "y").victims("a", now=10.0) == ()  # room left: nothing goes


def test_no_capacity_means_no_victims() -> None:
    res = Residency()
    for t, name in enumerate("pqrs"):
        res.touch("a", name, float(t))
    assert res.capacity("a") is None and res.victims("a", now=9.0) == ()
    assert res.fits("a", now=9.0)


def test_victims_skip_loads_in_flight_and_recently_used_adapters() -> None:
    res = full(3, "x", "y", "z")  # used at 0, 1, 2
    assert res.victims("a", now=2.5, min_idle=2.0) == ("x",)  # y and z were used within 2 s
    res.unloaded("a", "x")
    assert res.begin_load("a", "w")  # the load in flight takes the freed slot
    assert res.victims("a", now=2.5, min_idle=2.0) == ()
    assert not res.fits("a", now=2.5, min_idle=2.0)  # all busy: no room to make
    assert res.victims("a", now=10.0, min_idle=2.0) == ("y",)
    res.end_load("a", "w", True, now=10.0)
    res.touch("a", "y", 10.0)
    res.touch("a", "z", 10.0)
    assert res.victims("a", now=10.0) == ("w",)  # loaded earlier, used least recently
    assert res.victims("a", now=10.0, min_idle=1.0) == ()


def test_an_in_flight_adapter_is_never_a_victim_even_when_oldest() -> None:
    res = full(2, "x", "y")
    assert res.begin_load("a", "x")  # a reload of x is under way
    assert res.victims("a", now=50.0) == ("y",)


def test_learned_drops_what_a_restarted_engine_no_longer_lists() -> None:
    res = full(4, "x", "y", "z")
    assert res.learned("a", ["z", "static"]) == Drift(added=("static",), dropped=("x", "y"))
    assert res.held("a") == ("static", "z")  # the unknown one counts as least recently used
    assert res.holders("x") == ()
    assert res.learned("a", []) == Drift(dropped=("static", "z"))  # a restart: nothing left


def test_learned_settles_a_load_the_engine_already_lists() -> None:
    res = Residency()
    assert res.begin_load("a", "x")
    res.learned("a", ["x"])
    assert res.holds("a", "x") and res.loads_in_flight() == ()
    res.end_load("a", "x", True, now=3.0)  # the late answer changes nothing
    assert res.held("a") == ("x",)


def test_forget_removes_a_backend_and_its_loads() -> None:
    res = full(2, "x")
    res.touch("b", "x", 1.0)
    assert res.begin_load("a", "y")
    res.forget("a")
    assert res.holders("x") == ("b",) and res.loads_in_flight() == ()
    res.end_load("a", "y", True, now=2.0)  # the load's answer after the backend left
    assert not res.holds("a", "y") and res.backends() == ("b",)


def test_capacity_is_checked() -> None:
    with pytest.raises(ValueError):
        Residency().set_capacity("a", -1)


def test_demand_tends_to_the_request_rate_and_decays_by_half_life() -> None:
    demand = Demand(half_life=10.0)
    for i in range(2000):  # 4 requests per second for 500 s
        demand.observe("x", i * 0.25)
    assert demand.rate("x", 500.0) == pytest.approx(4.0, rel=0.05)
    assert demand.rate("x", 510.0) == pytest.approx(demand.rate("x", 500.0) / 2)
    assert demand.rate("never", 500.0) == 0.0
    assert demand.rates(500.0).keys() == {"x"}


def test_demand_prunes_adapters_gone_quiet() -> None:
    demand = Demand(half_life=1.0)
    demand.observe("old", 0.0)
    demand.observe("new", 30.0)
    assert demand.prune(30.0) == ("old",)
    assert demand.rates(30.0).keys() == {"new"}
    assert math.isclose(demand.rate("new", 30.0), math.log(2))
    with pytest.raises(ValueError):
        Demand(half_life=0.0)


def test_an_adapter_chosen_to_leave_is_not_taken_back_from_the_engines_list() -> None:
    res = full(1, "old")
    res.leave("a", "old")  # a load's victim: the engine is told later
    assert not res.holds("a", "old")
    res.learned("a", ["old"], read_at=5.0)  # the engine still lists it
    assert not res.holds("a", "old")
    res.unloaded("a", "old")
    res.learned("a", ["old"], read_at=6.0)  # listed after its unload: someone loaded it
    assert res.holds("a", "old")


def test_an_adapter_in_use_is_never_a_victim() -> None:
    res = full(1, "busy")
    res.begin_use("a", "busy")
    assert res.victims("a", now=100.0) == () and not res.fits("a", now=100.0)
    res.end_use("a", "busy")
    assert res.victims("a", now=100.0) == ("busy",)
