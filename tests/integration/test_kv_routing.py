"""Routing from the engines' own KV-cache events, through real processes: sims publish
BlockStored/BlockRemoved as vLLM does (ipc sockets, which they bind), control indexes them,
shims report which blocks a served prefix implies, and the `ttft` policy credits a backend
only the blocks its engine still holds."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.procs import Part
from tests.integration.harness import MODEL, Fleet, start_control, start_shim, start_sim, wait_until

pytestmark = pytest.mark.timeout(120)
SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 12}


def kv_fleet(tmp_path: Path, n: int = 2) -> Fleet:
    sims: dict[str, Part] = {}
    lines = ['routing = "ttft"', "[probes]", "interval = 0.2", "timeout = 0.5", ""]
    for i in range(n):
        pub, replay = f"ipc://{tmp_path}/s{i}.pub", f"ipc://{tmp_path}/s{i}.replay"
        sims[f"s{i}"] = start_sim("--kv-block-size", "8", "--kv-cache-blocks", "40",
                                  "--kv-events-endpoint", pub,
                                  "--kv-events-replay-endpoint", replay)  # fmt: skip
        lines += ["[[backends]]", f'id = "s{i}"', f'url = "{sims[f"s{i}"].ready}"',
                  f'model = "{MODEL}"', f'kv_events = "{pub}"', f'kv_events_replay = "{replay}"',
                  ""]  # fmt: skip
    (tmp_path / "control.toml").write_text("\n".join(lines))
    control = start_control(tmp_path / "control.toml")
    shim = start_shim(control.ready)
    return Fleet(sims, control, shim, [*sims.values(), control, shim])


def route_of(f: Fleet, request_id: str) -> dict[str, Any]:
    (row,) = json.loads(f.baton("events", "--kind", "route", "--request-id", request_id,
                                "--json").stdout)  # fmt: skip
    return row


def uncached(detail: str) -> int:
    m = re.search(r"uncached (\d+) tok", detail)
    assert m, detail
    return int(m.group(1))


def chat(c: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[str, str]:
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=12, stream=True
    )  # type: ignore[call-overload]
    text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
    return raw.headers["x-request-id"], text


def test_a_prefix_is_credited_while_its_blocks_are_held_and_not_after_eviction(
    tmp_path: Path,
) -> None:
    f = kv_fleet(tmp_path)
    try:
        assert wait_until(lambda: all(r["kv_index"] == "live" for r in f.backends().values()),
                          15)  # fmt: skip
        c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
        messages = [SYSTEM, {"role": "user", "content": "hi"}]
        rid, reply = chat(c, messages)
        home = route_of(f, rid)["backend_id"]
        assert wait_until(lambda: f.backends()[home]["kv_blocks"] > 2, 10)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go"}]
        rid, reply = chat(c, messages)
        warm = route_of(f, rid)
        assert warm["backend_id"] == home and warm["reason"] == "predicted", warm
        held = uncached(warm["detail"])
        # Other prompts, straight to the engine, push the conversation's blocks out of its
        # cache: it says so (BlockRemoved), and control stops crediting them.
        before = f.backends()[home]["kv_blocks"]
        for i in range(4):
            body = json.dumps({"model": MODEL, "prompt": f"{i} other words " * 30,
                               "max_tokens": 1}).encode()  # fmt: skip
            req = urllib.request.Request(f.sims[home].ready + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            urllib.request.urlopen(req, timeout=30).read()
        assert wait_until(lambda: f.backends()[home]["kv_blocks"] != before, 10)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "on"}]
        rid, _ = chat(c, messages)
        cold = route_of(f, rid)
        assert uncached(cold["detail"]) >= held + 3 * 8, (warm["detail"], cold["detail"])
    finally:
        for p in reversed(f.parts):
            p.stop(grace=3)
