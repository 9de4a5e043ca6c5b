"""`python -m bench.overhead`: what Baton (shim + control round trip) adds over a direct
connection to the same simulated engine, measured in the same run.

One sim, one control plane (that sim as its only backend) and one shim run as real processes.
For each mode (non-streaming, streaming), concurrency and rep, a closed-loop load runs against
the sim directly and through the shim, alternating which goes first per rep so drift hits both.
By default the sim and the load generator share one core and Baton gets another (`--no-pin` to
let the scheduler decide). Prints a table and PASS/FAIL lines; writes raw + summary JSON.
Benchmarks never gate: the exit status says only whether the benchmark itself ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import stats
from bench.cpu import Cores, pin, plan_cores
from bench.parts import MODEL, control_argv, control_toml, shim_argv, sim_argv
from clients.procs import Part

NONSTREAM_TOKENS = 8
DEFAULT_JSON = Path(__file__).parent / "results" / "overhead.json"
# The sim's cost model zeroed: any time measured is software, the engine's and Baton's.
SIM_ARGS = ("--prefill-us-per-token", "0", "--decode-ms-per-step", "0")


@dataclass(frozen=True, slots=True)
class Plan:
    concurrency: tuple[int, ...]
    duration: float
    warmup: float
    reps: int
    stream_tokens: int
    pinned: bool


@dataclass(frozen=True, slots=True)
class System:
    sim: Part
    control: Part
    shim: Part
    cores: Cores | None

    def url(self, target: str) -> str:
        return self.sim.ready if target == "direct" else self.shim.ready


@contextlib.contextmanager
def running_system(logdir: Path, cores: Cores | None) -> Iterator[System]:
    """Start sim → control → shim; stop them in reverse order on any exit, Ctrl-C included."""
    logdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:

        def start(name: str, argv: list[str]) -> Part:
            # Parts' stderr goes to files: a warning per request must not garble the table.
            log = stack.enter_context((logdir / f"overhead.{name}.log").open("wb"))
            part = Part(name, argv, stderr=log.fileno())
            stack.callback(part.stop, 3.0)
            return part

        sim = start("sim", sim_argv("127.0.0.1:0", *SIM_ARGS))
        config = logdir / "overhead.control.toml"
        config.write_text(control_toml({"s0": sim.ready}))
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        if cores is not None:
            pin(sim.proc.pid, cores.engine)
            pin(control.proc.pid, cores.baton)
            pin(shim.proc.pid, cores.baton)
        system = System(sim, control, shim, cores)
        await_serving(system.url("baton"))
        yield system


def await_serving(base: str, timeout: float = 15.0, model: str = MODEL) -> None:
    """Until the shim answers 200: control may still be probing its backend's health."""
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(
            base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} did not serve a completion within {timeout}s")
        time.sleep(0.2)


def run_load(system: System, plan: Plan, target: str, mode: str, conc: int) -> dict[str, Any]:
    """One closed-loop run in a `bench.loadgen` child; its CPU is then pinned and accounted
    apart from this process's."""
    stream = mode == "stream"
    argv = [
        sys.executable, "-m", "bench.loadgen", "--url", system.url(target),
        "--concurrency", str(conc), "--duration", str(plan.duration),
        "--warmup", str(plan.warmup), "--model", MODEL,
        "--max-tokens", str(plan.stream_tokens if stream else NONSTREAM_TOKENS),
        "--pid", f"sim={system.sim.proc.pid}",
        "--pid", f"shim={system.shim.proc.pid}",
        "--pid", f"control={system.control.proc.pid}",
    ]  # fmt: skip
    if stream:
        argv.append("--stream")
    if system.cores is not None:
        argv += [a for core in sorted(system.cores.engine) for a in ("--cpu", str(core))]
    return run_loadgen(argv, plan.warmup + plan.duration + 90, f"for {target} {mode} c={conc}")


def run_loadgen(argv: list[str], timeout: float, what: str) -> dict[str, Any]:
    """Runs a `bench.loadgen` argv to its end and returns the JSON it printed. `what` names
    the run in the error if it fails."""
    # Own session: Ctrl-C reaches only us, and the finally below ends the child.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"loadgen exited {proc.returncode} {what}")
    result: dict[str, Any] = json.loads(out)
    return result


def run_all(system: System, plan: Plan) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for mode in ("nonstream", "stream"):
        for conc in plan.concurrency:
            for rep in range(plan.reps):
                order = ("direct", "baton") if rep % 2 == 0 else ("baton", "direct")
                for target in order:
                    raw = run_load(system, plan, target, mode, conc)
                    raw.update(target=target, mode=mode, concurrency=conc, rep=rep)
                    runs.append(raw)
                    s = stats.run_stats(raw)
                    print(
                        f"  {mode:9} c={conc:<3} rep {rep} {target:6} {s.rps:8.0f} rps"
                        f"  p50 {s.p50_ms:7.3f} ms  errors {s.errors}",
                        file=sys.stderr,
                        flush=True,
                    )
    return runs


def report(cells: list[stats.Cell]) -> str:
    lines = [
        stats.render_table(stats.OVERHEAD_HEADERS, stats.overhead_rows(cells)),
        "",
        "d = direct to the sim, b = through Baton; latencies in ms; medians across reps;",
        "shim/ctl us/r = CPU microseconds per request; err = errors summed over reps.",
        "",
        "CPU used during the window (fraction of one core):",
        stats.render_table(stats.CPU_HEADERS, stats.cpu_rows(cells)),
        "",
    ]
    for t in stats.targets(cells):
        op = ">=" if t.higher_is_better else "<="
        lines.append(f"{t.verdict}  {t.name}: {stats.fmt(t.value, 3)} ({op} {t.limit:g})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    p.add_argument("--quick", action="store_true", help="1 s per run, 1 rep")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated worker counts")
    p.add_argument("--duration", type=float, help="seconds measured per run (default 3)")
    p.add_argument("--warmup", type=float, help="seconds before each window (default 0.5)")
    p.add_argument("--reps", type=int, help="repetitions per cell (default 3)")
    p.add_argument("--stream-tokens", type=int, default=64, help="max_tokens when streaming")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    a = p.parse_args(argv)
    plan = Plan(
        concurrency=tuple(int(c) for c in a.concurrency.split(",") if c.strip()),
        duration=a.duration if a.duration is not None else (1.0 if a.quick else 3.0),
        warmup=a.warmup if a.warmup is not None else (0.25 if a.quick else 0.5),
        reps=a.reps if a.reps is not None else (1 if a.quick else 3),
        stream_tokens=a.stream_tokens,
        pinned=not a.no_pin,
    )
    return plan, a.json


def results_doc(
    plan: Plan, cores: Cores | None, cells: list[stats.Cell], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    summary = [
        {
            **asdict(c),
            "ratio": c.ratio,
            "added_p50_ms": c.added_p50_ms,
            "added_ttft_p50_ms": c.added_ttft_p50_ms,
        }
        for c in cells
    ]
    return {
        "plan": asdict(plan),
        "cores": None
        if cores is None
        else {"engine": sorted(cores.engine), "baton": sorted(cores.baton)},
        "python": platform.python_version(),
        "summary": summary,
        "targets": [{**asdict(t), "verdict": t.verdict} for t in stats.targets(cells)],
        "runs": runs,
    }


def _finite(value: Any) -> Any:
    """NaN (a metric not measured) becomes null: JSON has no NaN and readers choke on it."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    plan, json_path = parse_args(argv)
    cores = plan_cores(plan.pinned)
    if plan.pinned and cores is None:
        print("fewer than 2 usable cores: running unpinned", file=sys.stderr)
    try:
        with running_system(json_path.parent, cores) as system:
            runs = run_all(system, plan)
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    cells = stats.summarize(runs)
    print(report(cells))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    doc = results_doc(plan, cores, cells, runs)
    json_path.write_text(json.dumps(_finite(doc), allow_nan=False))
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
