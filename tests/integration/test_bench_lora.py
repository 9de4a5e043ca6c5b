"""bench/lora.py in its --quick size, two of its modes (each mode is a fresh fleet: all four
took 47 s of the suite): it runs them on real sims, control and a shim, prints its table and
writes its JSON, and Baton's adapter routing loads adapters into the engines fewer times than
adapter-blind routing does on the same requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

MODES = ("baton", "roundrobin")


def test_quick_bench_compares_baton_with_round_robin_and_baton_loads_less(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    argv = [sys.executable, "-m", "bench.lora", "--quick", "--modes", ",".join(MODES),
            "--json", str(out)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=80)
    assert run.returncode == 0, run.stderr[-2000:]
    for mode in MODES:
        assert f" {mode} " in run.stdout, run.stdout
    assert "max_loras 2, max_cpu_loras 2" in run.stdout
    doc = json.loads(out.read_text())
    (exponent,) = doc["results"]  # --quick: one Zipf exponent
    by_mode = doc["results"][exponent]
    assert set(by_mode) == set(MODES)
    for mode, r in by_mode.items():
        assert r["requests"] == doc["plan"]["requests"], mode
        assert r["errors"] == 0, (mode, r["error_kinds"])
        assert r["ttft_p50_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"], (mode, r)
        assert r["loads"] >= 0, mode
    # Cold start: Baton loads each adapter it is asked for at least once.
    assert by_mode["baton"]["loads"] >= 1
    assert by_mode["baton"]["loads"] < by_mode["roundrobin"]["loads"]
    assert {t["verdict"] for t in doc["targets"]} <= {"PASS", "FAIL"}
    assert len(doc["targets"]) == 2  # loads and p99, against the blind mode
