"""Health and adaptive prefix-affinity routing through real processes: control, shims, sims."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    Fleet,
    fleet,
    http_full,
    metric,
    start_shim,
    start_sim,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 20}
JSON = {"Content-Type": "application/json"}


def chat(base_url: str, messages: list[dict[str, Any]], **kw: Any) -> tuple[str, str]:
    """(reply text, request id) of one chat turn through a shim."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **kw}
    status, raw, headers = http_full(
        "POST", base_url + "/chat/completions", json.dumps(body).encode(), JSON
    )
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["message"]["content"], headers["X-Request-Id"]


def route_event(f: Fleet, request_id: str) -> dict[str, Any]:
    out = f.baton("events", "--kind", "route", "--request-id", request_id, "--json")
    (event,) = json.loads(out.stdout)
    return dict(event)


def conversation(f: Fleet, base_url: str, turns: int) -> list[dict[str, Any]]:
    """An agent loop: every turn re-sends the whole history. Returns each turn's route event."""
    messages: list[dict[str, Any]] = [SYSTEM]
    events = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"step {i}: read file {i}.py"})
        reply, rid = chat(base_url, messages)
        messages.append({"role": "assistant", "content": reply})
        events.append(route_event(f, rid))
    return events


def test_continuations_follow_their_pin_fresh_turns_spread(tmp_path: Path) -> None:
    with fleet(tmp_path, n=3) as f:
        events = conversation(f, f.base_url, 4)
        first, rest = events[0], events[1:]
        assert first["reason"] == "spread"
        assert [e["reason"] for e in rest] == ["pin-hit"] * 3
        assert {e["backend_id"] for e in rest} == {first["backend_id"]}
        pins = json.loads(f.baton("pins", "list", "--json").stdout)
        assert pins["total"] > 0
        assert {p["backend_id"] for p in pins["pins"]} == {first["backend_id"]}
        cleared = json.loads(f.baton("pins", "clear", "--json").stdout)["cleared"]
        assert cleared == pins["total"]
        assert json.loads(f.baton("pins", "list", "--json").stdout)["total"] == 0


def test_a_conversation_started_on_shim_a_continues_on_its_backend_through_shim_b(
    tmp_path: Path,
) -> None:
    with fleet(tmp_path, n=3) as f:
        shim_b = start_shim(f.control.ready)
        f.parts.append(shim_b)
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "hello"}]
        reply, rid = chat(f.base_url, messages)
        home = route_event(f, rid)["backend_id"]
        for i, base in enumerate([shim_b.ready + "/v1", f.base_url, shim_b.ready + "/v1"]):
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"and then {i}"},
            ]
            reply, rid = chat(base, messages)
            event = route_event(f, rid)
            assert (event["reason"], event["backend_id"]) == ("pin-hit", home)


def test_same_prefix_burst_spreads_evenly(tmp_path: Path) -> None:
    with fleet(tmp_path, n=3) as f:

        def one(i: int) -> str:
            return chat(f.base_url, [SYSTEM, {"role": "user", "content": f"task {i}"}])[1]

        with ThreadPoolExecutor(9) as pool:
            rids = list(pool.map(one, range(9)))
        reasons = {route_event(f, rid)["reason"] for rid in rids}
        assert reasons == {"spread"}
        served = [metric(s.ready, "vllm:request_success_total") for s in f.sims.values()]
        assert served == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("how", ["drained", "removed", "dead"])
def test_pinned_backend_gone_is_repinned_without_error(tmp_path: Path, how: str) -> None:
    with fleet(tmp_path, n=3, probe_interval=60) as f:
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "hello"}]
        reply, rid = chat(f.base_url, messages)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        home = route_event(f, rid)["backend_id"]
        if how == "drained":
            assert f.baton("backends", "drain", home).returncode == 0
        elif how == "removed":
            assert f.baton("backends", "remove", home).returncode == 0
        else:
            f.sims[home].kill()
        reply, rid = chat(f.base_url, messages)  # 200 or chat() fails
        event = route_event(f, rid)
        if how == "dead":
            # Control learns it is dead from the failed attempt, which the shim retries.
            retries = json.loads(f.baton("events", "--kind", "retry", "--json").stdout)
            assert [(e["request_id"], e["backend_id"]) for e in retries] == [(rid, home)]
        else:
            assert event["reason"] == "repin" and event["backend_id"] != home
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go"}]
        _, rid = chat(f.base_url, messages)
        event = route_event(f, rid)
        assert event["reason"] == "pin-hit" and event["backend_id"] != home


def test_overloaded_pinned_backend_spills(tmp_path: Path) -> None:
    spill = "[affinity]\nspill_factor = 1.0\nspill_slack = 1\n"
    slow = ("--decode-ms-per-step", "25")
    with fleet(tmp_path, n=2, sim_args=slow, control_extra=spill) as f:
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "hello"}]
        reply, rid = chat(f.base_url, messages, max_tokens=2)
        home = route_event(f, rid)["backend_id"]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
        c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
        streams = []
        for _ in range(2):  # two long continuations keep the pinned card busy
            s = c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=400, temperature=0, stream=True
            )
            next(iter(s))
            streams.append(s)
        rows = f.backends()
        assert rows[home]["in_flight"] == 2  # control sees the shim's in-flight requests
        _, rid = chat(f.base_url, messages, max_tokens=2)
        event = route_event(f, rid)
        assert event["reason"] == "spill" and event["backend_id"] != home
        for s in streams:
            s.close()


def test_replica_stopped_mid_burst_every_request_is_200(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2, sim_args=("--decode-ms-per-step", "5")) as f:
        done = threading.Event()
        statuses: list[int] = []

        def one(i: int) -> int:
            body = {
                "model": MODEL,
                "messages": [SYSTEM, {"role": "user", "content": f"q{i}"}],
                "max_tokens": 16,
                "temperature": 0,
            }
            status, _, _ = http_full(
                "POST", f.base_url + "/chat/completions", json.dumps(body).encode(), JSON
            )
            if i == 12:
                done.set()
            return status

        s0 = f.sims["s0"].ready
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(48)]
            assert done.wait(30)
            # Mid-burst, with requests provably in flight on it (a busy machine can leave it
            # idle at any given instant) and more to come.
            assert wait_until(lambda: metric(s0, "vllm:num_requests_running") > 0, 30, 0.002)
            f.sims["s0"].kill()
            statuses = [fu.result() for fu in futures]
        assert statuses == [200] * 48
        retries = json.loads(f.baton("events", "--kind", "retry", "--json").stdout)
        assert retries and {e["backend_id"] for e in retries} == {"s0"}
        health = json.loads(
            f.baton("events", "--kind", "health", "--backend", "s0", "--json").stdout
        )
        assert [e["state"] for e in health][:1] == ["demoted"]
        assert sum(e["state"] == "demoted" for e in health) == 1


def test_probes_mark_down_and_readmit_a_restarted_backend(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2) as f:
        port = f.sims["s0"].ready.rsplit(":", 1)[1]
        f.sims["s0"].kill()
        assert wait_until(lambda: f.backends()["s0"]["state"] == "down", 10)
        assert "probe" in str(f.backends()["s0"]["reason"])
        revived = Part(
            "sim", ["sim", "--listen", f"127.0.0.1:{port}", "--model", MODEL, "--instant"]
        )
        f.parts.append(revived)
        assert wait_until(lambda: f.backends()["s0"]["state"] == "healthy", 10)
        states = [
            e["state"]
            for e in json.loads(
                f.baton("events", "--kind", "health", "--backend", "s0", "--json").stdout
            )
        ]
        assert states == ["demoted", "down", "healthy"]


def test_routing_env_selects_the_policy(tmp_path: Path) -> None:
    from tests.integration.harness import start_control, write_config

    sim = start_sim()
    config = write_config(tmp_path / "c.toml", [("s0", sim.ready)])
    ctl = start_control(config, env={"ROUTING": "affinity"})
    try:
        f = Fleet({"s0": sim}, ctl, ctl)
        assert json.loads(f.baton("status", "--json").stdout)["routing_policy"] == "affinity"
    finally:
        ctl.stop()
        sim.stop()
