"""A shim that is only busy must not look dead: a storm of ten times what the fleet holds,
through one shim on this machine with the load generator beside it, while probes poll as a
kubelet does (a new connection each time). Liveness answers fast throughout (the front door
answers it, dataplane/edge/health.py), readiness says 503 while the shim is at its in-flight cap
and 200 again soon after, every request is served or shed with a clean 429, and no stream
that was admitted is cut. Control's gRPC health and metrics port are polled the same way.

The storm is bounded in time and count (bench.storm, in a process of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.storm import Probe, grpc_health_probe, percentile
from tests.integration.harness import fleet

# Alone: other tests' processes beside it would be load it did not make (make test runs it last).
pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]

SEQS = 16  # what each sim runs at once (vLLM's --max-num-seqs)
SIMS = 2
CAP = SEQS * SIMS  # the shim's in-flight cap: what the fleet holds
STORM = 10 * CAP  # concurrent clients
SECONDS = 6.0


def test_probes_answer_fast_through_a_storm_and_every_request_ends_well(tmp_path: Path) -> None:
    sims = ("--decode-ms-per-step", "2", "--max-num-seqs", str(SEQS))
    with fleet(tmp_path, n=SIMS, sim_args=sims, shim_args=("--max-streams", str(CAP))) as f:
        host, port = f.shim.ready.removeprefix("http://").rsplit(":", 1)
        live = Probe(host, int(port), "/health/live")
        ready = Probe(host, int(port), "/health/ready")
        metrics_at = f.control.announced["METRICS"].removeprefix("http://").split("/")[0]
        m_host, m_port = metrics_at.rsplit(":", 1)
        scrape = Probe(m_host, int(m_port), "/metrics")
        checks: list[float] = []
        not_serving: list[str] = []
        stop = threading.Event()
        checker = threading.Thread(
            target=grpc_health_probe, args=(f.control.ready, checks, stop, not_serving)
        )
        for probe in (live, ready, scrape):
            probe.start()
        checker.start()
        t0 = time.monotonic()
        try:
            out = subprocess.run(
                [sys.executable, "-m", "bench.storm", "--storm", f.shim.ready,
                 "--concurrency", str(STORM), "--seconds", str(SECONDS), "--limit", "20000"],
                capture_output=True, text=True, timeout=120, check=True,
            )  # fmt: skip
            ended = time.monotonic() - t0
            # Readiness comes back once the storm's last streams are done.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not [
                s for s in ready.samples if s[0] > ended and s[1] == 200
            ]:
                time.sleep(0.05)
        finally:
            for probe in (live, ready, scrape):
                probe.stop()
            stop.set()
            checker.join(10)
        result = json.loads(out.stdout)
        outcomes = result["outcomes"]
        # Every request ended well: served whole, or shed with a clean 429.
        assert set(outcomes) <= {"served", "shed"}, outcomes
        assert outcomes.get("served", 0) > CAP and outcomes.get("shed", 0) > CAP, outcomes
        during = [s for s in live.samples if s[0] <= ended]
        lat = [t for _, _, t in during]
        assert all(status == 200 for _, status, _ in during), during
        assert len(lat) > 50, len(lat)
        p99 = percentile(lat, 0.99)
        print(f"live: n={len(lat)} p99={p99 * 1000:.1f} ms max={max(lat) * 1000:.1f} ms; "
              f"storm {outcomes} in {result['elapsed_s']} s")  # fmt: skip
        assert p99 < 0.050, f"/health/live p99 {p99 * 1000:.1f} ms"
        assert max(lat) < 0.100, f"/health/live took {max(lat) * 1000:.1f} ms once"
        # Readiness: 503 while saturated, 200 within a second after the storm.
        busy = [s for s in ready.samples if s[0] <= ended and s[1] == 503]
        assert busy, "readiness never said the shim was saturated"
        back = [s[0] for s in ready.samples if s[0] > ended and s[1] == 200]
        assert back and back[0] - ended < 1.0, (ended, ready.samples[-20:])
        # Control under the same storm (every shim request is routed there).
        assert not not_serving, not_serving
        for name, values in (("gRPC health", checks), ("metrics", scrape.latencies())):
            assert values, name
            p99 = percentile(values, 0.99)
            print(f"control {name}: n={len(values)} p99={p99 * 1000:.1f} ms "
                  f"max={max(values) * 1000:.1f} ms")  # fmt: skip
            assert p99 < 0.050, f"control {name} p99 {p99 * 1000:.1f} ms"
