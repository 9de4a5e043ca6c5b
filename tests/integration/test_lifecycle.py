"""A shim's lifecycle through real processes: SIGTERM stops it gracefully (in-flight streams
finish, readiness says 503 at once while liveness stays 200, a new request gets a 503, the
process exits 0 and then nothing listens); streams still running at the deadline end with an
explicit error event; `--workers N` shares one port."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import MODEL, fleet, metric, wait_until
from tests.integration.harness import http as request

pytestmark = pytest.mark.timeout(60)

SLOW = ("--decode-ms-per-step", "20")


def open_stream(base: str, max_tokens: int) -> tuple[http.client.HTTPConnection, Iterator[str]]:
    """A streaming completion whose `data:` payloads are read one at a time."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200

    def events() -> Iterator[str]:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                yield line.removeprefix("data: ")

    return conn, events()


def refused(base: str) -> bool:
    """Whether a new connection attempt is refused (ECONNREFUSED: nothing listens). A
    connect that succeeds is not refused, nor one reset or timed out: those say a listener
    (or its backlog) was still there."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # ECONNRESET, a timeout, ...: not a refusal
        return False
    return False


def test_sigterm_lets_the_stream_in_flight_finish(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1, sim_args=SLOW) as f:
        # ~6 s of decoding: the room the listener has to close while the stream goes on
        # (idle it closes within ~0.1 s of SIGTERM).
        conn, events = open_stream(f.shim.ready, 300)
        seen = [next(events) for _ in range(3)]
        base = f.shim.ready
        assert request("GET", base + "/health/ready") == (200, b"ready")
        f.shim.proc.send_signal(signal.SIGTERM)
        # Readiness flips (a load balancer stops sending work), liveness does not (nobody
        # should kill a process that is finishing its streams), new work is turned away...
        assert wait_until(lambda: request("GET", base + "/health/ready")[0] == 503, 5)
        assert request("GET", base + "/health/ready") == (503, b"not ready: draining")
        assert request("GET", base + "/health/live") == (200, b"ok")
        assert request("GET", base + "/health") == (200, b"ok")
        status, body = request("POST", base + "/v1/completions", b'{"model": "m"}',
                               {"Content-Type": "application/json"})  # fmt: skip
        assert status == 503 and json.loads(body)["error"]["code"] == "shim_shutting_down"
        assert f.shim.alive  # ...while the stream goes on:
        after = next(events)  # it still yields tokens
        assert "error" not in json.loads(after), after
        seen += [after, *events]
        conn.close()
        assert seen[-1] == "[DONE]"
        chunks = [json.loads(e) for e in seen[:-1]]
        assert not [c for c in chunks if "error" in c]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) > 150
        assert f.shim.proc.wait(10) == 0
        assert refused(base)  # gone: nothing listens on its port


def test_streams_past_the_grace_end_with_an_error_event(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1, sim_args=SLOW, shim_args=("--shutdown-grace", "0.5")) as f:
        sim = f.sims["s0"].ready
        conn, events = open_stream(f.shim.ready, 1000)  # ~20 s: far past the grace
        next(events)
        signalled = time.monotonic()
        f.shim.proc.send_signal(signal.SIGTERM)
        rest = list(events)
        conn.close()
        assert rest[-1] == "[DONE]"  # never a silent truncation
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "shim_shutting_down" and error["type"] == "service_unavailable"
        assert f.shim.proc.wait(10) == 0
        # Ended at the 0.5 s grace, not with the stream (~20 s): 10 s is 20x the grace and
        # half what waiting for the stream would take.
        assert time.monotonic() - signalled < 10
        tokens = sum(1 for e in rest[:-2] if json.loads(e).get("choices"))
        assert tokens < 1000, tokens  # cut short, not finished
        # The upstream request was cancelled with the client's stream: the engine is free.
        assert wait_until(lambda: metric(sim, "vllm:num_requests_running") == 0, 5)


def test_workers_share_the_port_and_stop_together(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1, shim_args=("--workers", "2", "--shutdown-grace", "5")) as f:
        pid = f.shim.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert len(children) == 2
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
        for _ in range(8):  # a new connection each: the kernel spreads them
            status, _ = request("POST", f.base_url + "/completions", body,
                             {"Content-Type": "application/json"})  # fmt: skip
            assert status == 200
        served = metric(f.sims["s0"].ready, "vllm:request_success_total")
        assert served == 8
        f.shim.proc.send_signal(signal.SIGTERM)
        assert f.shim.proc.wait(15) == 0
        assert all(not Path(f"/proc/{c}").exists() for c in children)
