"""The shim, control and sims as real processes, driven by the official OpenAI SDK."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import openai
import pytest

from tests.factories import sdk
from tests.integration.harness import MODEL, fleet, http, metric, wait_until

pytestmark = pytest.mark.timeout(90)


def client(base_url: str) -> openai.OpenAI:
    return sdk(base_url, timeout=30)


CHAT = [{"role": "user", "content": "tell me about routers"}]


def test_chat_and_completions_streaming_and_not(tmp_path: Path) -> None:
    with fleet(tmp_path) as f:
        c = client(f.base_url)
        whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
        assert whole.model == MODEL and whole.choices[0].message.content
        assert whole.usage is not None and whole.usage.completion_tokens == 24

        chunks = list(
            c.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True
            )
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == whole.choices[0].message.content  # greedy: same text streamed or not
        assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1
        assert chunks[-1].choices[0].finish_reason == "length"

        comp = c.completions.create(model=MODEL, prompt="once upon", max_tokens=16, temperature=0)
        streamed = "".join(
            ch.choices[0].text
            for ch in c.completions.create(
                model=MODEL, prompt="once upon", max_tokens=16, temperature=0, stream=True
            )
        )
        assert comp.choices[0].text and streamed == comp.choices[0].text


def test_models_health_and_round_robin_spread(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2) as f:
        c = client(f.base_url)
        assert [m.id for m in c.models.list().data] == [MODEL]
        assert http("GET", f.shim.ready + "/health")[0] == 200
        for _ in range(6):
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        served = [metric(s.ready, "vllm:request_success_total") for s in f.sims.values()]
        assert served == [3.0, 3.0]


def test_connect_failure_before_first_byte_is_retried_and_demotes(tmp_path: Path) -> None:
    # Probes slow enough that only the shim's report can demote the dead backend.
    with fleet(tmp_path, n=2, probe_interval=60) as f:
        f.sims["s0"].kill()
        c = client(f.base_url)
        # Round robin puts every other request on the dead one first: all must still be 200.
        for i in range(4):
            stream = i % 2 == 0
            if stream:
                text = "".join(
                    ch.choices[0].text
                    for ch in c.completions.create(
                        model=MODEL, prompt="hi", max_tokens=8, stream=True
                    )
                )
            else:
                text = c.completions.create(model=MODEL, prompt="hi", max_tokens=8).choices[0].text
            assert text
        rows = f.backends()
        assert rows["s0"]["state"] == "demoted"
        assert str(rows["s0"]["reason"]).startswith("connect")
        assert rows["s1"]["state"] == "healthy"
        retries = json.loads(f.baton("events", "--kind", "retry", "--json").stdout)
        assert retries and {e["backend_id"] for e in retries} == {"s0"}
        assert {e["failure"] for e in retries} == {"connect"}
        assert all(e["v"] == 1 and e["request_id"] for e in retries)
        health = json.loads(f.baton("events", "--kind", "health", "--json").stdout)
        assert any(e["backend_id"] == "s0" and e["state"] == "demoted" for e in health)


def test_all_backends_dead_is_a_clear_503_or_502(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1) as f:
        f.sims["s0"].kill()
        status, body = http(
            "POST",
            f.base_url + "/completions",
            json.dumps({"model": MODEL, "prompt": "x"}).encode(),
            {"Content-Type": "application/json"},
        )
        assert status in (502, 503)
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/chat/completions", b"{oops", 400, None),
        ("/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
        ("/chat/completions", b'{"model": "toy"}', 400, "messages"),
        ("/chat/completions", b'{"model": "toy", "messages": "x"}', 400, "messages"),
        (
            "/chat/completions",
            b'{"model": "toy", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
            400,
            "max_tokens",
        ),
        ("/completions", b'{"model": "toy", "prompt": {"a": 1}}', 400, "prompt"),
        ("/completions", b'{"model": "nope", "prompt": "x"}', 404, "model"),
        ("/completions", b'{"model": "toy", "prompt": "' + b"x" * 5000 + b'"}', 413, None),
        ("/nowhere", b"{}", 404, None),
    ],
)
def test_bad_input_gets_openai_shaped_errors(
    tmp_path: Path, path: str, body: bytes, status: int, param: str | None, shared_fleet
) -> None:
    got, raw = http(
        "POST", shared_fleet.base_url + path, body, {"Content-Type": "application/json"}
    )
    assert got == status
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_sdk_maps_errors_to_its_exceptions(shared_fleet) -> None:
    c = client(shared_fleet.base_url)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[])


def test_client_disconnect_cancels_the_upstream_generation(tmp_path: Path) -> None:
    slow = ("--decode-ms-per-step", "20")
    with fleet(tmp_path, n=1, sim_args=slow) as f:
        sim = f.sims["s0"].ready
        host, port = f.shim.ready.removeprefix("http://").split(":")
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True})
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            received = b""
            while received.count(b"data:") < 3:
                received += sock.recv(65536)
            assert wait_until(lambda: metric(sim, "vllm:num_requests_running") == 1, 5)
        # 2000 tokens at 20 ms would take 40 s; the engine must stop within a few.
        assert wait_until(lambda: metric(sim, "vllm:num_requests_running") == 0, 5)


def test_control_plane_down_serves_from_the_last_snapshot(tmp_path: Path) -> None:
    # docs/architecture.md#when-control-is-unreachable: no longer a 503;
    # tests/integration/test_outage.py goes further.
    from tests.integration.harness import metric as sample

    with fleet(tmp_path, n=1) as f:
        c = client(f.base_url)
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
        f.control.kill()
        status, body = http(
            "POST",
            f.base_url + "/completions",
            json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200 and json.loads(body)["choices"][0]["text"]
        assert sample(f.shim.ready, "baton_shim_degraded") == 1
        assert sample(f.shim.ready, "baton_shim_degraded_routes_total") >= 1
        assert http("GET", f.shim.ready + "/health")[0] == 200  # the shim itself survives


def test_prometheus_metrics_on_shim_and_control(tmp_path: Path) -> None:
    from tests.integration.harness import metric as sample

    crash = [("--fault", "die-after=4")]
    with fleet(tmp_path, n=2, per_sim=crash, probe_interval=60) as f:
        c = client(f.base_url)
        text = "".join(
            ch.choices[0].text
            for ch in c.completions.create(
                model=MODEL, prompt="x", max_tokens=12, temperature=0, stream=True
            )
        )
        assert text
        c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="nope", prompt="x")
        shim = f.shim.ready
        assert (
            sample(shim, "baton_shim_requests_total", 'endpoint="/v1/completions",status="200"')
            == 2
        )
        assert sample(shim, "baton_shim_requests_total", 'status="404"') == 1
        assert sample(shim, "baton_shim_failovers_total", 'failure="disconnect"') == 1
        assert sample(shim, "baton_shim_route_seconds_count") == 3
        assert sample(shim, "baton_shim_requests_in_flight") == 0
        control = f.control.announced["METRICS"].removesuffix("/metrics")
        assert sample(control, "baton_routes_total", 'reason="spread"') >= 2
        assert sample(control, "baton_backends", 'state="demoted"') == 1
        assert sample(control, "baton_backends", 'state="healthy"') == 1
        assert wait_until(
            lambda: sample(control, "baton_failovers_total", 'outcome="resumed"') == 1, 5
        )
        assert sample(control, "baton_route_decision_seconds_count") >= 2
