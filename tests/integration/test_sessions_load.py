"""Routing that sees the engines, through real processes: a client's session id pins its
conversation across shims; an engine kept busy by requests Baton never sent is avoided by
the `ttft` policy, from the engine's own gauges (which `baton backends list` shows)."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import MODEL, Fleet, fleet, start_shim, wait_until

pytestmark = pytest.mark.timeout(120)


def routes(f: Fleet) -> list[dict[str, Any]]:
    return json.loads(f.baton("events", "--kind", "route", "--json").stdout)


def test_a_session_follows_its_conversation_across_two_shims(tmp_path: Path) -> None:
    with fleet(tmp_path, n=3) as f:
        second = start_shim(f.control.ready)
        try:
            a = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
            b = openai.OpenAI(base_url=second.ready + "/v1", api_key="x", max_retries=0)
            hello = [{"role": "user", "content": "hello"}]
            a.chat.completions.create(model=MODEL, max_tokens=4, messages=hello,  # type: ignore[arg-type]
                                      extra_body={"session_id": "s-1"})  # fmt: skip
            (first,) = routes(f)
            home = first["backend_id"]
            # Another shim, a rewritten history the prefix pins have never seen, the header
            # instead of the field: the session still finds its backend.
            for turn in range(3):
                b.chat.completions.create(
                    model=MODEL, max_tokens=4, extra_headers={"x-session-id": "s-1"},
                    messages=[{"role": "user", "content": f"summary {turn}"},
                              {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": "go on"}],
                )  # fmt: skip
            later = routes(f)[1:]
            assert [r["backend_id"] for r in later] == [home] * 3
            assert {r["reason"] for r in later} == {"pin-hit"}
            pins = json.loads(f.baton("pins", "list", "--kind", "session", "--json").stdout)
            assert [(p["key"], p["backend_id"]) for p in pins["pins"]] == [("s-1", home)]
            # Subject to drain like any pin: the conversation moves, and the pin with it.
            assert f.baton("backends", "drain", home).returncode == 0
            b.chat.completions.create(
                model=MODEL, max_tokens=4, extra_headers={"x-session-id": "s-1"},
                messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                          {"role": "user", "content": "z"}],
            )  # fmt: skip
            moved = routes(f)[-1]
            assert moved["backend_id"] != home and moved["reason"] == "repin"
            pins = json.loads(f.baton("pins", "list", "--kind", "session", "--json").stdout)
            assert pins["pins"][0]["backend_id"] == moved["backend_id"]
        finally:
            second.stop(grace=3)


def test_a_backend_busy_with_requests_baton_never_sent_is_avoided(tmp_path: Path) -> None:
    # Two sequences at a time: of four long requests, two run and two wait, as on a full card.
    slow = ("--decode-ms-per-step", "20", "--max-num-seqs", "2")
    with fleet(tmp_path, n=2, per_sim=[slow, slow],
               control_extra='routing = "ttft"\n[load]\ninterval = 0.2\n') as f:  # fmt: skip
        busy = f.sims["s0"].ready
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 400}).encode()

        def outside() -> None:  # straight to the engine: Baton never sees these
            req = urllib.request.Request(busy + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            urllib.request.urlopen(req, timeout=60).read()

        jobs = [threading.Thread(target=outside) for _ in range(4)]
        for j in jobs:
            j.start()
        try:
            # Control reads s0's own gauges: 2 running, 2 waiting, none of them Baton's.
            assert wait_until(lambda: f.backends()["s0"]["engine"].startswith("2+2"), 15)
            assert f.backends()["s0"]["in_flight"] == 0
            c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
            for i in range(4):
                c.completions.create(model=MODEL, prompt=f"q{i}", max_tokens=2)
            mine = routes(f)[-4:]
            assert [r["backend_id"] for r in mine] == ["s1"] * 4
            assert {r["reason"] for r in mine} == {"predicted"}
        finally:
            for j in jobs:
                j.join(60)
