"""The sim as one ``vllm serve --data-parallel-size 2`` (vLLM's internal load balancer):
two engine ranks behind one HTTP port, each with its own prefix cache, scheduler,
metrics children (``engine="R"``) and KV-event publisher (real sim processes, ZMQ on
127.0.0.1). Requests are pinned with ``X-data-parallel-rank`` or balanced; a long
request is held open by a stall fault, and every wait is a bounded poll on state."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.procs import Part
from scripts.engines.replicas import free_ports
from sim.__main__ import add_arguments, config_from_args
from sim.server import start_server
from sim.state import STATE
from tests.integration.harness import FAST_SIM, http, wait_until
from tests.integration.test_sim_kv_events import (
    BS,
    VLLM_PY,
    AllBlocksCleared,
    Ctx,
    Subscriber,
    kv_sim,
    sources,
    stores,
)

RANK = "X-data-parallel-rank"
JSON = {"Content-Type": "application/json"}
# What the sim binds, as vLLM would: vLLM binds an endpoint with "::" in it (or a wildcard,
# which would listen on every address), and an IPv4-mapped loopback binds 127.0.0.1 alone.
BIND = "tcp://[::ffff:127.0.0.1]"


# -- helpers ----------------------------------------------------------------------------
def dp_sim(*extra: str, size: int = 2) -> Part:
    """A DP sim publishing on port-0 binds (each rank gets its own ports)."""
    return kv_sim(
        "--data-parallel-size", str(size),
        "--kv-events-endpoint", f"{BIND}:0",
        "--kv-events-replay-endpoint", "tcp://127.0.0.1:0", *extra,
    )  # fmt: skip


def complete(
    sim: Part, prompt: list[int], rank: str | None = None, max_tokens: int = 1
) -> tuple[int, dict[str, Any]]:
    body = {"model": "toy", "prompt": prompt, "max_tokens": max_tokens}
    headers = JSON if rank is None else {**JSON, RANK: rank}
    status, data = http("POST", sim.ready + "/v1/completions", json.dumps(body).encode(), headers)
    return status, json.loads(data)


def served(sim: Part, prompt: list[int], rank: str | None = None) -> None:
    status, body = complete(sim, prompt, rank)
    assert status == 200, body


def per_engine(sim: Part, family: str) -> dict[str, float]:
    """One family's value per engine label, from /metrics as prometheus_client parses it."""
    _, text = http("GET", sim.ready + "/metrics")
    for fam in text_string_to_metric_families(text.decode()):
        if fam.name == family:
            return {
                s.labels["engine"]: s.value
                for s in fam.samples
                if s.name in (family, family + "_total")
            }
    raise AssertionError(f"{family} not exported")


def prompt_tokens(sim: Part) -> dict[str, float]:
    return per_engine(sim, "vllm:prompt_tokens")


@contextmanager
def held(sim: Part, rank: str | None = None) -> Iterator[None]:
    """A streamed completion that stalls after its first token until the block ends (the
    disconnect cancels it): it keeps a slot of its rank running meanwhile."""
    url = urlsplit(sim.ready)
    conn = HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=10)
    body = {"model": "toy", "prompt": [5, 6, 7], "max_tokens": 50, "stream": True}
    headers = {**JSON, "X-Sim-Fault": "stall-after=1,stall-seconds=60"}
    if rank is not None:
        headers[RANK] = rank
    try:
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
        assert conn.getresponse().status == 200
        yield
    finally:
        conn.close()


def running(sim: Part) -> dict[str, float]:
    return per_engine(sim, "vllm:num_requests_running")


@pytest.fixture(scope="module")
def dp() -> Iterator[Part]:
    """Shared by the tests that only pin requests (the balancer's turn is not theirs)."""
    p = dp_sim()
    yield p
    p.stop(grace=3)


@pytest.fixture
def fresh() -> Iterator[Part]:
    """A DP sim of a test's own: the balancer's turn starts at rank 0."""
    p = dp_sim()
    yield p
    p.stop(grace=3)


# -- sources and startup lines ------------------------------------------------------------
def test_each_rank_reports_its_own_bound_endpoints(dp: Part) -> None:
    src = sources(dp)
    assert sorted(src) == ["0", "1"]
    ends = [src[r][k] for r in ("0", "1") for k in ("endpoint", "replay_endpoint")]
    assert len(set(ends)) == 4 and not any(e.endswith(":0") for e in ends)
    assert all(src[r]["endpoint"].startswith("tcp://127.0.0.1:") for r in ("0", "1")), src
    # Rank 0's lines as a single engine prints them; rank 1's carry its rank.
    assert dp.announced == {
        "KV_EVENTS": src["0"]["endpoint"], "KV_REPLAY": src["0"]["replay_endpoint"],
        "KV_EVENTS_DP1": src["1"]["endpoint"], "KV_REPLAY_DP1": src["1"]["replay_endpoint"],
    }  # fmt: skip


def test_one_rank_reports_only_rank_0() -> None:
    p = dp_sim(size=1)
    try:
        assert list(sources(p)) == ["0"]
        assert sorted(p.announced) == ["KV_EVENTS", "KV_REPLAY"]
        assert list(running(p)) == ["0"]
    finally:
        p.stop(grace=3)


def test_fixed_ports_move_up_by_the_rank(ctx: Ctx) -> None:
    pub = free_ports(4)  # two ranks' event ports, then their replay ports
    replay = pub + 2
    p = kv_sim("--data-parallel-size", "2", "--kv-events-endpoint", f"{BIND}:{pub}",
               "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}")  # fmt: skip
    try:
        src = sources(p)
        assert (src["0"]["endpoint"], src["0"]["replay_endpoint"]) == (
            f"{BIND}:{pub}", f"tcp://127.0.0.1:{replay}")  # fmt: skip
        assert (src["1"]["endpoint"], src["1"]["replay_endpoint"]) == (
            f"{BIND}:{pub + 1}", f"tcp://127.0.0.1:{replay + 1}")  # fmt: skip
        # Rank 1 really publishes there.
        sub = Subscriber(ctx, {**src["1"], "endpoint": f"tcp://127.0.0.1:{pub + 1}"})
        served(p, list(range(30, 38)), rank="1")
        assert stores(sub.wait_for(lambda ev: bool(stores(ev, 30))), 30)
        sub.close()
    finally:
        p.stop(grace=3)


def test_an_ipc_endpoint_with_two_ranks_refuses_to_start(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sim", "--listen", "127.0.0.1:0", "--data-parallel-size", "2",
         "--kv-events-endpoint", f"ipc://{tmp_path}/kv"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "SIM READY" not in done.stdout
    assert "cannot be moved for data-parallel rank 1" in done.stderr


# -- pinned requests ---------------------------------------------------------------------
def test_a_pinned_repeat_hits_its_ranks_prefix_cache_only(dp: Part) -> None:
    hits0 = per_engine(dp, "vllm:prefix_cache_hits")
    tokens0 = prompt_tokens(dp)
    prompt = list(range(40, 50))  # 2 full blocks of 4 and 2 tokens
    served(dp, prompt, rank="1")
    served(dp, prompt, rank="1")
    hits, tokens = per_engine(dp, "vllm:prefix_cache_hits"), prompt_tokens(dp)
    assert hits["1"] - hits0["1"] == 2 * BS
    assert hits["0"] == hits0["0"]
    assert (tokens["0"] - tokens0["0"], tokens["1"] - tokens0["1"]) == (0, 2 * len(prompt))
    # The same prompt pinned to rank 0 starts cold there.
    served(dp, prompt, rank="0")
    assert per_engine(dp, "vllm:prefix_cache_hits")["0"] == hits0["0"]


def test_chat_completions_honour_the_header_too(dp: Part) -> None:
    before = prompt_tokens(dp)
    body = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    status, data = http("POST", dp.ready + "/v1/chat/completions", json.dumps(body).encode(),
                        {**JSON, RANK: "1"})  # fmt: skip
    assert status == 200, data
    after = prompt_tokens(dp)
    assert after["0"] == before["0"] and after["1"] > before["1"]


def test_a_rank_out_of_range_is_a_400_and_a_non_integer_is_ignored(dp: Part) -> None:
    for bad in ("2", "-1"):
        status, body = complete(dp, [1, 2, 3], rank=bad)
        assert status == 400
        assert body["error"]["message"] == f"data_parallel_rank {bad} is out of range [0, 2)."
        assert body["error"]["type"] == "BadRequestError"
    before = sum(prompt_tokens(dp).values())
    status, body = complete(dp, [1, 2, 3], rank="one")
    assert status == 200, body
    assert sum(prompt_tokens(dp).values()) == before + 3


def test_responses_are_balanced_whatever_the_header(dp: Part) -> None:
    """vLLM's Responses path never reads X-data-parallel-rank: an out-of-range value is
    no error there."""
    body = {"model": "toy", "input": "hello", "max_output_tokens": 2}
    status, data = http("POST", dp.ready + "/v1/responses", json.dumps(body).encode(),
                        {**JSON, RANK: "9"})  # fmt: skip
    assert status == 200, data


def test_metrics_is_one_page_with_every_family_once_and_both_engines(dp: Part) -> None:
    _, raw = http("GET", dp.ready + "/metrics")
    text = raw.decode()
    helps = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP ")]
    assert len(helps) == len(set(helps))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits",
                 "vllm:prefix_cache_queries", "vllm:cache_config_info"):  # fmt: skip
        assert {s.labels["engine"] for s in families[name].samples} == {"0", "1"}, name
        assert {s.labels.get("model_name", "toy") for s in families[name].samples} == {"toy"}


def test_reset_prefix_cache_resets_every_rank(dp: Part, ctx: Ctx) -> None:
    subs = {r: Subscriber(ctx, s) for r, s in sources(dp).items()}
    a, b = list(range(100, 108)), list(range(120, 128))
    served(dp, a, rank="0")
    served(dp, b, rank="1")
    status, body = http("POST", dp.ready + "/reset_prefix_cache")
    assert (status, json.loads(body)) == (200, {"success": True})
    for sub in subs.values():  # each rank's publisher says so
        sub.wait_for(lambda ev: bool(ev) and isinstance(ev[-1], AllBlocksCleared))
        sub.close()
    hits = per_engine(dp, "vllm:prefix_cache_hits")
    served(dp, a, rank="0")
    served(dp, b, rank="1")
    assert per_engine(dp, "vllm:prefix_cache_hits") == hits  # both came back cold


# -- KV events per rank -------------------------------------------------------------------
def test_each_rank_publishes_its_own_blocks_with_its_own_sequence(dp: Part, ctx: Ctx) -> None:
    src = sources(dp)
    subs = {r: Subscriber(ctx, src[r]) for r in ("0", "1")}
    try:
        served(dp, list(range(140, 148)), rank="1")
        served(dp, list(range(160, 168)), rank="0")
        served(dp, list(range(180, 188)), rank="1")  # after 160's: rank 1 would have it by now
        ev1 = subs["1"].wait_for(lambda ev: bool(stores(ev, 140)) and bool(stores(ev, 180)))
        ev0 = subs["0"].wait_for(lambda ev: bool(stores(ev, 160)))
        assert not stores(ev1, 160) and not stores(ev0, 140)
        (one,) = stores(ev1, 140)
        assert one.token_ids == list(range(140, 148)) and one.parent_block_hash is None
        for rank, sub in subs.items():
            # Numbered from 0 by each publisher (the subscriber has every batch from 0 on,
            # replayed or live), and each batch stamped with its rank.
            assert 0 in sub.batches and sub.next_missing() == len(sub.batches)
            assert {b.data_parallel_rank for b in sub.batches.values()} == {int(rank)}
    finally:
        for sub in subs.values():
            sub.close()


# -- the internal load balancer -------------------------------------------------------------
def test_concurrent_long_requests_land_on_different_ranks(fresh: Part) -> None:
    with held(fresh):
        assert wait_until(lambda: running(fresh) == {"0": 1.0, "1": 0.0}), running(fresh)
        with held(fresh):  # rank 0 is busy: rank 1 takes it
            assert wait_until(lambda: running(fresh) == {"0": 1.0, "1": 1.0}), running(fresh)
    assert wait_until(lambda: running(fresh) == {"0": 0.0, "1": 0.0}), running(fresh)


def test_a_busy_rank_is_passed_over_until_it_is_free(fresh: Part) -> None:
    with held(fresh, rank="1"):
        assert wait_until(lambda: running(fresh)["1"] == 1.0)
        before = prompt_tokens(fresh)
        for base in (200, 220, 240):
            served(fresh, list(range(base, base + 4)))
        after = prompt_tokens(fresh)
        assert (after["0"] - before["0"], after["1"] - before["1"]) == (12, 0)


def test_idle_ranks_take_turns_so_an_unpinned_repeat_misses_the_cache(fresh: Part) -> None:
    """vLLM's rotating scan: with both ranks idle, requests alternate, so a prefix cache
    hit needs the same rank twice (a third repeat is back on rank 0 and hits)."""
    prompt = list(range(260, 270))  # 2 full blocks and 2 tokens
    served(fresh, prompt)
    served(fresh, prompt)
    assert prompt_tokens(fresh) == {"0": 10.0, "1": 10.0}
    assert per_engine(fresh, "vllm:prefix_cache_hits") == {"0": 0.0, "1": 0.0}
    served(fresh, prompt)
    assert per_engine(fresh, "vllm:prefix_cache_hits") == {"0": 2.0 * BS, "1": 0.0}


# -- in process --------------------------------------------------------------------------
def test_an_in_process_dp_sim_reports_every_ranks_endpoints() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args([
        *FAST_SIM, "--data-parallel-size", "3", "--kv-events-endpoint", f"{BIND}:0",
    ]))  # fmt: skip

    async def go() -> tuple[dict[str, Any], int]:
        runner, port = await start_server(cfg)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/kv_event_sources") as resp:
                    src = await resp.json()
            return src, len(runner.app[STATE].engines)
        finally:
            await runner.cleanup()

    src, engines = asyncio.run(go())
    assert engines == 3 and sorted(src) == ["0", "1", "2"]
    assert len({s["endpoint"] for s in src.values()}) == 3


# -- against vLLM's own rule -----------------------------------------------------------------
@pytest.mark.real
@pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM venv (make engines)")
def test_the_offset_rule_is_vllms() -> None:
    from sim.kv_wire import offset_endpoint_port

    cases = [("tcp://*:5557", 1), ("tcp://*:5557", 3), ("tcp://127.0.0.1:0", 2),
             ("tcp://[::1]:6000", 1), ("inproc://cache", 2), ("ipc:///tmp/kv", 0),
             ("ipc:///tmp/kv", 1), ("", 1)]  # fmt: skip
    script = (
        "import json, sys\n"
        "from vllm.distributed.kv_events import ZmqEventPublisher as P\n"
        "out = []\n"
        "for e, r in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        out.append(P.offset_endpoint_port(e, r))\n"
        "    except ValueError:\n"
        "        out.append('ValueError')\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([str(VLLM_PY), "-c", script, json.dumps(cases)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = []
    for e, r in cases:
        try:
            ours.append(offset_endpoint_port(e, r))
        except ValueError:
            ours.append("ValueError")
    assert ours == theirs

