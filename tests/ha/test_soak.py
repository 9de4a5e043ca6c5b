"""The replica group through a leader's death under load (bench/ha.py's parts, smaller
plans): real etcd, three control replicas, two shims given all three, sims SIGKILLed at
random."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.ha import HaFleet, Plan, soak, takeovers
from bench.overhead import await_serving

pytestmark = [pytest.mark.ha, pytest.mark.timeout(600)]


def test_a_1000_stream_soak_through_the_leaders_sigkill_loses_nothing(tmp_path: Path) -> None:
    plan = Plan(streams=1000, soak_seconds=0, concurrency=16, backends=3, tokens=32,
                kill_every=1.0, takeovers=0, conversations=0, pin_window=0, latency_n=0,
                seed=1)  # fmt: skip
    with HaFleet(tmp_path, plan.backends, single=False) as fleet:
        for shim in fleet.shims:
            await_serving(shim.ready)
        doc = asyncio.run(soak(fleet, plan))
    s = doc["summary"]
    assert (s["failed"], s["truncated"]) == (0, 0), s["errors_by_kind"]
    assert s["completed"] == s["sent"] >= 1000
    assert s["identical_pct"] == 100.0
    assert doc["sim_kills"] > 0 and s["failovers"] > 0  # the soak had failovers to lose
    # Every failover a shim reported is in the new leader's log (the shims' own counters).
    assert s["audit_reported"] == s["failovers"] and s["audit_lost"] == 0, s
    assert doc["config_intact"]
    kill = doc["leader_kill"]
    assert kill["old"] != kill["new"], kill


def test_a_new_leader_routes_within_two_seconds_of_the_old_ones_sigkill(tmp_path: Path) -> None:
    with HaFleet(tmp_path, 2, single=False) as fleet:
        took = takeovers(fleet, 3)
    assert max(took) <= 2.0, took
