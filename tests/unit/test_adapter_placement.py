"""LoRA adapter placement (control.routing.adapters): rendezvous-hashed home sets sized by
demand, holders preferred, loads only where the home set says, minimal disruption when the
fleet changes, and far fewer adapter loads than a least-loaded router blind to adapters."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from hashlib import blake2b
from random import Random

import pytest

from control.fleet.adapters import Demand, Residency
from control.routing.adapters import (
    Placement,
    PlaceReason,
    Tuning,
    home_size,
    place,
    place_resume,
    rank,
    weight,
)

R = PlaceReason
FLEET = ("r0", "r1", "r2")


def go(adapter: str, res: Residency, load: dict[str, float] | None = None,
       fleet: tuple[str, ...] = FLEET, rate: float = 0.0, now: float = 0.0,
       **kw: float) -> Placement:  # fmt: skip
    return place(adapter, fleet, res, rate, load or {}, Tuning(10.0, **kw), now=now)


def serve(res: Residency, adapter: str, p: Placement, now: float) -> int:
    """Do what the router will do with a placement; returns the loads it issued."""
    assert p.backend is not None
    for name in p.evict:
        res.unloaded(p.backend, name)
    started = p.needs_load and res.begin_load(p.backend, adapter)
    if started:
        res.end_load(p.backend, adapter, True, now)
    res.touch(p.backend, adapter, now)
    return int(started)


def test_weights_are_a_stable_hash_and_ranks_ignore_candidate_order() -> None:
    key = blake2b(b"sql\x00r1", digest_size=8, person=b"baton.lora.v1").digest()
    assert weight("sql", "r1") == int.from_bytes(key, "big")
    assert rank("sql", FLEET) == rank("sql", FLEET[::-1]) == rank("sql", FLEET + FLEET)
    assert sorted(rank("sql", FLEET)) == list(FLEET)


def test_home_size_follows_demand() -> None:
    assert [home_size(r, 10.0, 3) for r in (0.0, 5.0, 10.0, 10.1, 25.0, 1e9)] == [1, 1, 1, 2, 3, 3]
    assert home_size(5.0, 10.0, 0) == 0


def test_no_candidate_is_a_placement_not_an_error() -> None:
    assert go("x", Residency(), fleet=()) == Placement(None, R.NO_CANDIDATE)


def test_a_cold_adapter_stays_on_one_replica_across_many_requests() -> None:
    res, rng, loads, used = Residency(), Random(7), 0, set()
    for i in range(300):
        load = {b: float(rng.randrange(0, 20)) for b in FLEET}  # busy, never saturated
        p = go("cold", res, load, rate=2.0, now=float(i))
        loads += serve(res, "cold", p, float(i))
        used.add(p.backend)
    assert loads == 1 and used == {rank("cold", FLEET)[0]}


def test_a_first_request_loads_on_the_top_ranked_replica() -> None:
    p = go("x", Residency(), {FLEET[0]: 5.0})
    assert (p.backend, p.reason, p.needs_load) == (rank("x", FLEET)[0], R.HOME_LOAD, True)


def test_a_load_into_a_full_replica_unloads_its_least_recently_used() -> None:
    res = Residency()
    top = rank("x", FLEET)[0]
    res.set_capacity(top, 2)
    res.touch(top, "old", 1.0)
    res.touch(top, "new", 2.0)
    p = go("x", res, now=10.0)
    assert (p.backend, p.needs_load, p.evict) == (top, True, ("old",))


def test_a_load_in_flight_is_joined_not_repeated() -> None:
    res = Residency()
    first = go("x", res)
    assert first.backend and res.begin_load(first.backend, "x")
    again = go("x", res)
    assert (again.backend, again.reason, again.needs_load) == (first.backend, R.HOLDER, True)
    assert again.evict == () and not res.begin_load(first.backend, "x")


def test_a_hot_adapter_spreads_with_demand_and_shrinks_back_as_it_decays() -> None:
    res, demand, inflight = Residency(), Demand(half_life=5.0), deque[tuple[float, str]]()
    spans: list[int] = []

    def burst(start: float, seconds: float, per_second: int) -> set[str]:
        used = set()
        for i in range(int(seconds * per_second)):
            now = start + i / per_second
            while inflight and inflight[0][0] <= now:
                inflight.popleft()
            demand.observe("hot", now)
            load = {b: float(sum(1 for _, x in inflight if x == b)) for b in FLEET}
            p = go("hot", res, load, rate=demand.rate("hot", now), now=now)
            serve(res, "hot", p, now)
            inflight.append((now + 0.5, str(p.backend)))  # each request runs 0.5 s
            used.add(str(p.backend))
        spans.append(home_size(demand.rate("hot", now), 10.0, 3))
        return used

    assert burst(0.0, 20.0, 2) == {rank("hot", FLEET)[0]}  # 2/s: one replica is enough
    assert burst(20.0, 20.0, 25) == set(FLEET)  # 25/s over 10/s per replica: all three
    burst(40.0, 20.0, 1)  # quiet again: demand decays (half-life 5 s)...
    assert burst(60.0, 60.0, 1) == {rank("hot", FLEET)[0]}  # ...and it is back home
    assert spans == [1, 3, 1, 1]


def test_spreading_only_over_the_home_set() -> None:
    res = Residency()
    top, second, third = rank("x", FLEET)
    res.touch(top, "x", 0.0)
    p = go("x", res, {top: 4.0}, rate=15.0)  # k = 2: the second home member loads it
    assert (p.backend, p.reason, p.needs_load) == (second, R.SPREAD, True)
    p = go("x", res, {top: 4.0, second: 4.0}, rate=15.0)  # third is not home: no spread
    assert (p.backend, p.reason) == (top, R.HOLDER)
    p = go("x", res, {top: 0.5}, rate=15.0)  # below the spread margin: the holder keeps it
    assert p.backend == top and third not in p.home


@pytest.mark.parametrize("k", [1, 2])
def test_a_replica_leaving_or_joining_moves_only_adapters_whose_home_changed(k: int) -> None:
    fleet = tuple(f"r{i}" for i in range(6))
    adapters = [f"lora-{i}" for i in range(300)]

    def homes(backends: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
        return {a: rank(a, backends)[:k] for a in adapters}

    def primaries(backends: tuple[str, ...]) -> dict[str, str | None]:
        return {a: go(a, Residency(), fleet=backends).backend for a in adapters}

    before, after = homes(fleet), homes(fleet[:-1])  # r5 leaves
    for a in adapters:  # the survivors of a home set stay in it, in order
        assert after[a][: len(before[a]) - ("r5" in before[a])] == tuple(
            b for b in before[a] if b != "r5")  # fmt: skip
    changed = {a for a in adapters if before[a] != after[a]}
    assert changed == {a for a in adapters if "r5" in before[a]}
    assert 0.5 * k / 6 < len(changed) / len(adapters) < 1.6 * k / 6  # about k/n of them
    one, six = primaries(fleet[:-1]), primaries(fleet)  # r5 joins
    moved = {a for a in adapters if one[a] != six[a]}
    assert moved and all(six[a] == "r5" for a in moved)  # only onto the newcomer


def test_a_holder_outside_the_home_serves_before_any_load() -> None:
    res = Residency()
    top, second, third = rank("x", FLEET)
    res.touch(third, "x", 0.0)
    busy = {top: 9.0, second: 1.0, third: 5.0}
    p = go("x", res, busy, saturated_at=8.0)  # the home is saturated
    assert (p.backend, p.reason, p.needs_load) == (third, R.STRAY_HOLDER, False)
    p = go("x", res, {top: 1.0, third: 5.0}, saturated_at=8.0)  # the home has room too
    assert (p.backend, p.reason, p.needs_load) == (third, R.STRAY_HOLDER, False)
    p = go("x", res, {top: 1.0, third: 9.0}, saturated_at=8.0)  # the holder is saturated
    assert (p.backend, p.reason, p.needs_load) == (top, R.HOME_LOAD, True)


def test_saturated_everywhere_loads_on_the_least_loaded_candidate() -> None:
    top, second, third = rank("x", FLEET)
    p = go("x", Residency(), {top: 9.0, second: 12.0, third: 10.0}, saturated_at=8.0)
    assert (p.backend, p.reason, p.needs_load) == (top, R.FALLBACK, True)


def test_a_resume_goes_to_a_surviving_holder() -> None:
    res = Residency()
    top, second, third = rank("x", FLEET)
    res.touch(top, "x", 0.0)
    res.touch(third, "x", 0.0)
    tuning = Tuning(per_replica_rate=10.0)
    p = place_resume("x", top, FLEET, res, 0.0, {third: 7.0}, tuning, now=1.0)
    assert (p.backend, p.needs_load) == (third, False)
    assert p.reason == R.RESUME_HOLDER  # even though `second` is now its home
    p = place_resume("x", top, FLEET, Residency(), 0.0, {}, tuning, now=1.0)  # next home
    assert (p.backend, p.reason, p.needs_load) == (second, R.HOME_LOAD, True)
    saturated = Tuning(per_replica_rate=10.0, saturated_at=8.0)
    p = place_resume("x", top, FLEET, res, 0.0, {third: 9.0}, saturated, now=1.0)
    assert (p.backend, p.reason) == (second, R.HOME_LOAD)  # the holder is saturated


# The bar: Zipf demand over 12 adapters, 3 replicas holding 2 each, engines modelled as
# LRU caches of that capacity (what they really hold: a load past capacity evicts, as vLLM's
# --max-cpu-loras does), 20 requests/s of 0.4 s each. A load is any request (or preload) that
# finds its adapter not in its engine's cache, for both routers alike.
# Measured: 2.2x fewer loads at s=1.0, 3.0-3.3x at 1.5, 3.1-3.5x at 2.0 (seeds 1-3). The
# issue's 5x is out of reach with 6 slots for 12 adapters: at s=1.0 the 6 least asked-for
# adapters draw ~21% of requests and must miss whatever the router does, against ~70% blind.
CAPACITY, ADAPTERS = 2, tuple(f"lora-{i}" for i in range(12))


def engine_serves(cache: OrderedDict[str, None], adapter: str) -> int:
    miss = adapter not in cache
    cache[adapter] = None
    cache.move_to_end(adapter)
    while len(cache) > CAPACITY:
        cache.popitem(last=False)
    return int(miss)


Route = Callable[[str, float, dict[str, float], dict[str, OrderedDict[str, None]]], str]


def zipf_loads(route: Route, s: float, seed: int) -> int:
    rng, engines = Random(seed), {b: OrderedDict[str, None]() for b in FLEET}
    weights, inflight, loads = [1 / (i + 1) ** s for i in range(12)], deque[tuple[float, str]](), 0
    for i in range(3000):
        now, adapter = i * 0.05, rng.choices(ADAPTERS, weights)[0]
        while inflight and inflight[0][0] <= now:
            inflight.popleft()
        load = {b: float(sum(1 for _, x in inflight if x == b)) for b in FLEET}
        backend = route(adapter, now, load, engines)
        loads += engine_serves(engines[backend], adapter)
        inflight.append((now + 0.4, backend))
    return loads


def baton_router(min_idle: float) -> Route:
    res, demand = Residency(), Demand(half_life=10.0)
    for b in FLEET:
        res.set_capacity(b, CAPACITY)

    def route(adapter: str, now: float, load: dict[str, float],
              engines: dict[str, OrderedDict[str, None]]) -> str:  # fmt: skip
        for b, cache in engines.items():  # what /v1/models lists (a poll, here each request)
            res.learned(b, cache)
        demand.observe(adapter, now)
        tuning = Tuning(per_replica_rate=10.0, min_idle=min_idle)
        p = place(adapter, FLEET, res, demand.rate(adapter, now), load, tuning, now=now)
        assert p.backend is not None
        for name in p.evict:  # the unload reaches the engine
            engines[p.backend].pop(name, None)
        serve(res, adapter, p, now)
        return p.backend

    return route


def blind(adapter: str, now: float, load: dict[str, float],
          engines: dict[str, OrderedDict[str, None]]) -> str:  # fmt: skip
    return min(FLEET, key=lambda b: (load[b], b))


@pytest.mark.parametrize("s", [1.0, 1.5, 2.0])
def test_zipf_demand_needs_far_fewer_loads_than_a_router_blind_to_adapters(s: float) -> None:
    for seed in (1, 2, 3):
        baton, base = zipf_loads(baton_router(min_idle=2.0), s, seed), zipf_loads(blind, s, seed)
        print(f"zipf s={s} seed={seed}: {baton} loads against {base} ({base / baton:.1f}x)")
        assert base >= 2 * baton
