"""The chaos benchmarks' engines: sims forked from a warm parent serve like `python -m sim`,
die for real on SIGKILL, and come back on their old port (bench/sim_zygote.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from bench.parts import sim_argv
from bench.sim_zygote import Zygote
from clients.procs import StartFailed
from tests.integration.harness import MODEL, http

pytestmark = pytest.mark.timeout(60)


def completes(base: str) -> bool:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    status, raw = http("POST", base + "/v1/completions", json.dumps(body).encode(),
                       {"Content-Type": "application/json"})  # fmt: skip
    return status == 200 and len(json.loads(raw)["choices"][0]["text"]) > 0


def refused(base: str) -> bool:
    try:
        urllib.request.urlopen(base + "/health", timeout=2)  # noqa: S310 - 127.0.0.1 only
    except urllib.error.URLError:
        return True
    return False


def test_forked_sims_serve_die_and_come_back_on_their_port() -> None:
    zygote = Zygote()
    try:
        first = zygote.spawn("s0", sim_argv("127.0.0.1:0")[1:])
        assert completes(first.ready)
        first.kill()  # SIGKILL: the process is gone and its port refuses
        assert not first.alive and refused(first.ready)
        port = first.ready.rsplit(":", 1)[1]
        again = zygote.spawn("s0", sim_argv(f"127.0.0.1:{port}")[1:])
        assert again.ready == first.ready and again.pid != first.pid
        assert completes(again.ready)
        # A port in use is a clear failure, not a hang.
        with pytest.raises(StartFailed):
            zygote.spawn("s1", sim_argv(f"127.0.0.1:{port}")[1:], timeout=10)
        again.stop(3.0)
        assert not again.alive
    finally:
        zygote.close()
