"""The ranks of one data-parallel engine as backends, through real processes: a sim run as
vLLM's `--data-parallel-size 2` (one API server, two engine cores, each with its own cache,
queue and KV-event stream), and two Baton backends on its one url, one per rank. Control
indexes each rank's stream apart and reads each rank's load from the shared /metrics page;
the shim names the rank on every call (X-data-parallel-rank), so a request reaches the engine
core Baton chose, not the one the engine's own balancer would pick."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from scripts.engines.replicas import free_ports
from tests.integration.harness import (
    MODEL,
    Fleet,
    metric,
    start_control,
    start_shim,
    start_sim,
    wait_until,
)
from tests.integration.test_kv_routing import SYSTEM, chat, route_of

pytestmark = pytest.mark.timeout(120)
RANKS = 2
# vLLM binds an endpoint with "::" in it; an IPv4-mapped loopback binds 127.0.0.1 alone.
BIND = "tcp://[::ffff:127.0.0.1]"


def rank_of(backend_id: str) -> int:
    return int(backend_id.rsplit("-r", 1)[1])


@contextmanager
def dp_fleet(tmp_path: Path, *sim_args: str, control_extra: str = "") -> Iterator[Fleet]:
    """The engine as its own flags say it, once (`data_parallel_size`): control declares the
    backends dp-r0 and dp-r1, each with its rank's event ports (port + R, as vLLM moves
    them)."""
    pub = free_ports(2 * RANKS)  # the ranks' event ports, then their replay ports
    replay = pub + RANKS
    sim = start_sim("--data-parallel-size", str(RANKS), "--kv-block-size", "8",
                    "--kv-events-endpoint", f"{BIND}:{pub}",
                    "--kv-events-replay-endpoint", f"{BIND}:{replay}", *sim_args)  # fmt: skip
    parts = [sim]
    try:
        lines = ['routing = "ttft"', control_extra, "[probes]", "interval = 0.2",
                 "timeout = 0.5", "", "[[backends]]", 'id = "dp"', f'url = "{sim.ready}"',
                 f'model = "{MODEL}"', f"data_parallel_size = {RANKS}",
                 f'kv_events = "tcp://127.0.0.1:{pub}"',
                 f'kv_events_replay = "tcp://127.0.0.1:{replay}"', ""]  # fmt: skip
        (tmp_path / "control.toml").write_text("\n".join(lines))
        control = start_control(tmp_path / "control.toml")
        parts.append(control)
        shim = start_shim(control.ready)
        parts.append(shim)
        yield Fleet({"dp": sim}, control, shim, parts)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def rank_hits(f: Fleet, rank: int) -> float:
    return metric(f.sims["dp"].ready, "vllm:prefix_cache_hits_total", f'engine="{rank}"')


def test_a_continuation_reaches_the_rank_that_holds_its_blocks(tmp_path: Path) -> None:
    with dp_fleet(tmp_path) as f:
        assert wait_until(lambda: all(r["kv_index"] == "live" for r in f.backends().values()),
                          15)  # fmt: skip
        c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
        messages = [SYSTEM, {"role": "user", "content": "hi"}]
        rid, reply = chat(c, messages)
        home = route_of(f, rid)["backend_id"]
        other = next(b for b in f.backends() if b != home)
        # The rank Baton chose stored the blocks, by its own stream; the other rank did not.
        assert wait_until(lambda: f.backends()[home]["kv_blocks"] > 2, 10)
        assert f.backends()[other]["kv_blocks"] == 0
        before = [rank_hits(f, r) for r in range(RANKS)]
        for turn in range(3):
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"go on {turn}"}]  # fmt: skip
            rid, reply = chat(c, messages)
            warm = route_of(f, rid)
            assert warm["backend_id"] == home and warm["reason"] == "predicted", warm
        after = [rank_hits(f, r) for r in range(RANKS)]
        # Each turn reached that engine core and hit its cache; the other core saw none. (The
        # engine's own balancer takes turns between idle cores: without the header the
        # continuations would have alternated.)
        assert after[rank_of(home)] - before[rank_of(home)] >= 3 * 8, (before, after)
        assert after[rank_of(other)] == before[rank_of(other)], (before, after)


def test_each_rank_reads_its_own_load_and_a_busy_one_is_avoided(tmp_path: Path) -> None:
    # Two sequences at a time per core: of four long requests on rank 0, two run, two wait.
    slow = ("--decode-ms-per-step", "20", "--max-num-seqs", "2")
    with dp_fleet(tmp_path, *slow, control_extra="[load]\ninterval = 0.2") as f:
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 400}).encode()

        def outside() -> None:  # straight to rank 0 of the engine: Baton never sees these
            req = urllib.request.Request(
                f.sims["dp"].ready + "/v1/completions", data=body,
                headers={"Content-Type": "application/json", "X-data-parallel-rank": "0"})
            urllib.request.urlopen(req, timeout=60).read()

        jobs = [threading.Thread(target=outside) for _ in range(4)]
        for j in jobs:
            j.start()
        try:
            # One /metrics page, each rank's gauges read apart: rank 0 2 running + 2 waiting,
            # rank 1 idle (a sum over the page would show both ranks 2+2).
            assert wait_until(lambda: f.backends()["dp-r0"]["engine"].startswith("2+2"), 15)
            assert f.backends()["dp-r1"]["engine"].startswith("0+0")
            c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
            ids = []
            for i in range(4):
                raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"q{i}",
                                                             max_tokens=2)  # fmt: skip
                ids.append(raw.headers["x-request-id"])
            mine = [route_of(f, rid) for rid in ids]
            assert [r["backend_id"] for r in mine] == ["dp-r1"] * 4, mine
            assert {r["reason"] for r in mine} == {"predicted"}
        finally:
            for j in jobs:
                j.join(60)


def test_a_rank_added_at_run_time_that_is_taken_is_refused(tmp_path: Path) -> None:
    with dp_fleet(tmp_path) as f:
        url = f.sims["dp"].ready
        out = f.baton("backends", "add", "again", "--url", url, "--model", MODEL,
                      "--data-parallel-rank", "1")  # fmt: skip
        assert out.returncode != 0
        assert "'dp-r1' already serves" in out.stderr and "data_parallel_rank" in out.stderr
        whole = f.baton("backends", "add", "whole", "--url", url, "--model", MODEL)
        assert whole.returncode != 0 and "already serves" in whole.stderr
        assert sorted(f.backends()) == ["dp-r0", "dp-r1"]
        # The rank column says which core each backend is.
        table = f.baton("backends", "list").stdout.splitlines()
        assert "RANK" in table[0]
        assert [line.split()[0] for line in table[1:]] == ["dp-r0", "dp-r1"]
        # A rank the engine does not run (a typo) is down, saying which ranks it runs, rather
        # than routed to and refused by the engine on every request.
        beyond = f.baton("backends", "add", "beyond", "--url", url, "--model", MODEL,
                         "--data-parallel-rank", "5")  # fmt: skip
        assert beyond.returncode == 0, beyond.stderr
        why = "data_parallel_rank 5: the engine runs ranks 0, 1"
        assert wait_until(lambda: why in str(f.backends()["beyond"]["reason"]), 10)
        assert f.backends()["beyond"]["state"] != "healthy"
        assert {f.backends()[b]["state"] for b in ("dp-r0", "dp-r1")} == {"healthy"}
