"""Where a request for a LoRA adapter goes (issue 42): rendezvous (highest-random-weight)
hashing gives each adapter a stable ranking of the backends serving its base, and its demand
decides how many of the top ones (its *home set*) it spans, so a cold adapter stays loaded on
one replica and a hot one spreads; loads happen on the home set, and a replica joining or
leaving moves only the adapters whose home it changes (llm-d's LoRA-affinity scorer and
Dynamo's HRW placement route adapters the same way).

    place(adapter, candidates, residency, demand_rate, load, tuning, *, now) -> Placement

(`Tuning`: per_replica_rate, saturated_at=inf, min_idle=0.0, spread_margin=1.0.)

- `candidates`: routable backend ids serving the adapter's base, in any order (the result does
  not depend on it); `load`: in-flight requests or a load score per backend (missing = 0);
- home set: the top k by `rank`, k = clamp(ceil(demand_rate / per_replica_rate), 1, n);
- in order: the least loaded home member that holds the adapter (or is loading it) and is
  below `saturated_at` -> HOLDER; if k exceeds the home members that have it and the best
  holder's load is `spread_margin` above a free home member's, that member loads it -> SPREAD;
  with no unsaturated holder at home, the least loaded unsaturated holder outside it ->
  STRAY_HOLDER (a request goes where its adapter is held before any load); else the
  highest-ranked unsaturated home member with room -> HOME_LOAD; else the least loaded
  candidate (a load; room preferred) -> FALLBACK; none -> NO_CANDIDATE.
  Room is `Residency.fits` with `min_idle`: adapters used within `min_idle` are not evicted.
- `Placement.needs_load`: the backend does not hold it yet. The caller calls
  `Residency.begin_load`; False means that load is already in flight (single flight) and the
  request waits for it. `evict` lists what to unload first (least recently used; may be short
  when the backend is full of busy adapters: the engine's own LRU then evicts, at a reload's
  cost, not a failure).

Failover: `place_resume` drops the failed backend and prefers the least loaded unsaturated
surviving holder (RESUME_HOLDER) even outside the home set: a resumed stream should not wait
for a load. With no such holder it is `place` over the survivors. Deterministic:
no randomness, ties break on backend id. Never raises for lack of capacity."""

# baton: pure

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from hashlib import blake2b

from control.fleet.adapters import Residency

_PERSON = b"baton.lora.v1"  # blake2b personalisation: these weights mean nothing else


class PlaceReason(StrEnum):
    """Why an adapter's request went where it went (audit log, span attribute, metric label)."""

    HOLDER = "holder"  # a home member already holds it
    SPREAD = "spread"  # demand asks for more replicas: a home member that lacks it loads it
    HOME_LOAD = "home_load"  # no home member holds it (or all holders are saturated): load
    STRAY_HOLDER = "stray_holder"  # the home set is saturated; a holder outside it
    RESUME_HOLDER = "resume_holder"  # a failed stream resumes where the adapter is held
    FALLBACK = "fallback"  # saturated everywhere it is held: the least loaded candidate loads
    NO_CANDIDATE = "no_candidate"  # nothing serves the base
    ADMIN = "admin"  # an operator's load (`baton adapters load`)


@dataclass(frozen=True, slots=True)
class Placement:
    backend: str | None
    reason: PlaceReason
    needs_load: bool = False
    evict: tuple[str, ...] = ()  # unload these on `backend` first, in this order
    home: tuple[str, ...] = ()  # the home set, best first (for the audit log)


def weight(adapter: str, backend: str) -> int:
    """The rendezvous weight of (adapter, backend): stable across processes and machines."""
    key = adapter.encode() + b"\x00" + backend.encode()
    return int.from_bytes(blake2b(key, digest_size=8, person=_PERSON).digest(), "big")


def rank(adapter: str, candidates: Sequence[str]) -> tuple[str, ...]:
    """The candidates by descending weight for `adapter` (ties: backend id)."""
    return tuple(sorted(set(candidates), key=lambda b: (-weight(adapter, b), b)))


def home_size(demand_rate: float, per_replica_rate: float, n: int) -> int:
    """How many replicas an adapter should span: ceil(rate / per-replica rate) in [1, n]."""
    if n <= 0:
        return 0
    if per_replica_rate <= 0 or not math.isfinite(demand_rate):
        return n
    return max(1, min(n, math.ceil(max(0.0, demand_rate) / per_replica_rate)))


@dataclass(frozen=True, slots=True)
class Tuning:
    """The operator's knobs of placement: the request rate one replica takes of an adapter
    (how home sets grow), the load at which a replica counts as saturated, how long an
    adapter must be idle before it may be unloaded, and the load gap that spreads a hot
    adapter to one more home member."""

    per_replica_rate: float
    saturated_at: float = math.inf
    min_idle: float = 0.0
    spread_margin: float = 1.0


def place(
    adapter: str,
    candidates: Sequence[str],
    residency: Residency,
    demand_rate: float,
    load: Mapping[str, float],
    tuning: Tuning,
    *,
    now: float,
) -> Placement:
    """Choose the backend for a request to `adapter` (see the module docstring)."""
    per_replica_rate, saturated_at = tuning.per_replica_rate, tuning.saturated_at
    min_idle, spread_margin = tuning.min_idle, tuning.spread_margin
    ranked = rank(adapter, candidates)
    if not ranked:
        return Placement(None, PlaceReason.NO_CANDIDATE)
    home = ranked[: home_size(demand_rate, per_replica_rate, len(ranked))]

    def lo(b: str) -> float:
        return load.get(b, 0.0)

    def has(b: str) -> bool:
        return residency.holds(b, adapter) or residency.loading(b, adapter)

    def free(b: str) -> bool:
        return lo(b) < saturated_at

    def room(b: str) -> bool:
        return residency.fits(b, now=now, min_idle=min_idle)

    def least(bs: Sequence[str]) -> str:
        return min(bs, key=lambda b: (lo(b), ranked.index(b)))

    def go(b: str, reason: PlaceReason) -> Placement:
        if residency.holds(b, adapter):
            return Placement(b, reason, home=home)
        evict = () if residency.loading(b, adapter) else residency.victims(
            b, now=now, min_idle=min_idle)  # fmt: skip
        return Placement(b, reason, True, evict, home)

    holders = [b for b in home if has(b) and free(b)]
    if holders:
        holder = least(holders)
        spare = [b for b in home if not has(b) and free(b) and room(b)]
        if spare and lo(holder) - lo(least(spare)) >= spread_margin:
            return go(least(spare), PlaceReason.SPREAD)
        return go(holder, PlaceReason.HOLDER)
    # A holder outside the home set serves it without a load (an operator's load, a spread
    # the demand has since shrunk from, a resume's): the rule, a holder first.
    strays = [b for b in ranked if b not in home and has(b) and free(b)]
    if strays:
        return go(least(strays), PlaceReason.STRAY_HOLDER)
    loader = next((b for b in home if free(b) and room(b)), None)
    if loader is not None:
        return go(loader, PlaceReason.HOME_LOAD)
    return go(least([b for b in ranked if room(b)] or ranked), PlaceReason.FALLBACK)


def place_resume(
    adapter: str,
    failed: str,
    candidates: Sequence[str],
    residency: Residency,
    demand_rate: float,
    load: Mapping[str, float],
    tuning: Tuning,
    *,
    now: float,
) -> Placement:
    """Where a failed stream for `adapter` resumes: the least loaded unsaturated surviving
    holder, else `place` without the failed backend."""
    survivors = [b for b in candidates if b != failed]
    ranked = rank(adapter, survivors)
    bound = tuning.saturated_at
    holders = [b for b in ranked if residency.holds(b, adapter) and load.get(b, 0.0) < bound]
    if holders:
        best = min(holders, key=lambda b: (load.get(b, 0.0), ranked.index(b)))
        return Placement(best, PlaceReason.RESUME_HOLDER, home=ranked[:1])
    return place(adapter, survivors, residency, demand_rate, load, tuning, now=now)
