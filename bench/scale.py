"""`python -m bench.scale`: throughput through Baton as the shim gets more worker processes
(`baton shim --workers N`, SO_REUSEPORT), next to the same load sent to a sim directly.

Sims run with their cost model off (`--instant`), so the engines are cheap and the shim's
CPU is what limits Baton. One Python shim process serves about one core: throughput grows
with workers until the machine's cores are used up by the shims, control, the sims and the
load generator together. The table says how many cores this machine has, and how busy each
part kept them, so a flat curve on a small machine reads as what it is.
Benchmarks never gate: the exit status says only whether the benchmark itself ran.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import stats
from bench.overhead import await_serving, run_loadgen
from bench.parts import MODEL, control_argv, control_toml, shim_argv, sim_argv
from clients.procs import Part

DEFAULT_JSON = Path(__file__).parent / "results" / "scale.json"


@dataclass(frozen=True, slots=True)
class Plan:
    workers: tuple[int, ...]
    sims: int
    concurrency: int
    duration: float
    warmup: float
    reps: int
    tokens: int
    cores: int


@dataclass(frozen=True, slots=True)
class Row:
    target: str  # "direct" or "baton"
    workers: int  # shim processes; 0 for direct
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu: dict[str, float]  # fraction of one core used in the window, per part


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


@contextlib.contextmanager
def started(logdir: Path, name: str, argv: list[str]) -> Iterator[Part]:
    # Parts' stderr goes to files: a warning per request must not garble the table.
    with (logdir / f"scale.{name}.log").open("wb") as log:
        part = Part(name, argv, stderr=log.fileno())
        try:
            yield part
        finally:
            part.stop(10.0)


def load(plan: Plan, url: str, pids: dict[str, int]) -> dict[str, Any]:
    """One closed-loop streaming run in a `bench.loadgen` child."""
    argv = [
        sys.executable, "-m", "bench.loadgen", "--url", url, "--stream",
        "--concurrency", str(plan.concurrency), "--duration", str(plan.duration),
        "--warmup", str(plan.warmup), "--model", MODEL, "--max-tokens", str(plan.tokens),
        *(a for name, pid in pids.items() for a in ("--pid", f"{name}={pid}")),
    ]  # fmt: skip
    return run_loadgen(argv, plan.warmup + plan.duration + 90, f"against {url}")


def row(target: str, workers: int, raws: list[dict[str, Any]]) -> Row:
    s = stats.median_stats([stats.run_stats(r) for r in raws])
    cpu: dict[str, float] = {}
    for name, util in s.cpu_util.items():
        part = name.rstrip("0123456789")  # shim0, shim1 -> shim; s0, s1 -> s
        cpu[part] = cpu.get(part, 0.0) + util
    return Row(target, workers, s.rps, s.p50_ms, s.p99_ms, s.errors, cpu)


def run(plan: Plan, logdir: Path) -> tuple[list[Row], list[dict[str, Any]]]:
    rows: list[Row] = []
    raw_runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        sims = [
            stack.enter_context(started(logdir, f"sim{i}", sim_argv("127.0.0.1:0", "--instant")))
            for i in range(plan.sims)
        ]
        config = logdir / "scale.control.toml"
        config.write_text(control_toml({f"s{i}": p.ready for i, p in enumerate(sims)}))
        control = stack.enter_context(started(logdir, "control", control_argv(str(config))))
        engine_pids = {f"s{i}": p.proc.pid for i, p in enumerate(sims)}

        raws = [load(plan, sims[0].ready, engine_pids) for _ in range(plan.reps)]
        raw_runs += [{**r, "target": "direct", "workers": 0} for r in raws]
        rows.append(row("direct", 0, raws))
        print(f"  direct      {rows[-1].rps:8.0f} rps", file=sys.stderr, flush=True)
        for n in plan.workers:
            argv = [*shim_argv(control.ready), "--workers", str(n)]
            with started(logdir, f"shim{n}", argv) as shim:
                await_serving(shim.ready)
                workers = children(shim.proc.pid) if n > 1 else [shim.proc.pid]
                pids = {
                    **engine_pids,
                    "control": control.proc.pid,
                    **{f"shim{i}": pid for i, pid in enumerate(workers)},
                }
                raws = [load(plan, shim.ready, pids) for _ in range(plan.reps)]
            raw_runs += [{**r, "target": "baton", "workers": n} for r in raws]
            rows.append(row("baton", n, raws))
            print(f"  workers={n:<3} {rows[-1].rps:8.0f} rps", file=sys.stderr, flush=True)
    return rows, raw_runs


def report(plan: Plan, rows: list[Row]) -> str:
    direct = rows[0].rps
    headers = ["target", "shims", "rps", "x direct", "p50 ms", "p99 ms", "err",
               "cpu shim", "cpu ctl", "cpu sims", "cpu loadgen"]  # fmt: skip
    table = [
        [
            r.target,
            str(r.workers) if r.workers else "-",
            stats.fmt(r.rps, 0),
            stats.fmt(r.rps / direct if direct else float("nan"), 2),
            stats.fmt(r.p50_ms, 2),
            stats.fmt(r.p99_ms, 2),
            str(r.errors),
            stats.fmt(r.cpu.get("shim", float("nan")), 2),
            stats.fmt(r.cpu.get("control", float("nan")), 2),
            stats.fmt(r.cpu.get("s", float("nan")), 2),
            stats.fmt(r.cpu.get("loadgen", float("nan")), 2),
        ]
        for r in rows
    ]
    note = (
        f"This machine has {plan.cores} usable core(s): the shims, control, {plan.sims} sim(s) "
        "and the load generator share them, so throughput stops growing once their CPU "
        f"adds up to {plan.cores}"
        + (" (on 2 cores that is at 1-2 shim workers)." if plan.cores <= 2 else ".")
    )
    return "\n".join(
        [
            stats.render_table(headers, table),
            "",
            f"Streaming completions, {plan.tokens} tokens, c={plan.concurrency}, sims --instant;",
            "direct = the same load to one sim; cpu = cores used during the window (1.0 = one).",
            note,
        ]
    )


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    p.add_argument("--quick", action="store_true", help="1 s per run, 1 rep")
    p.add_argument(
        "--workers",
        default=None,
        help="comma-separated shim worker counts (default 1,2,... up to the cores, at least 2)",
    )
    p.add_argument("--sims", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, help="seconds measured per run (default 3)")
    p.add_argument("--warmup", type=float, help="seconds before each window (default 0.5)")
    p.add_argument("--reps", type=int, help="repetitions per cell, median kept (default 2)")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens per streamed completion")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    a = p.parse_args(argv)
    workers = (
        tuple(int(w) for w in a.workers.split(",") if w.strip())
        if a.workers
        else tuple(range(1, max(2, cores) + 1))
    )
    plan = Plan(
        workers=workers,
        sims=a.sims,
        concurrency=a.concurrency,
        duration=a.duration if a.duration is not None else (1.0 if a.quick else 3.0),
        warmup=a.warmup if a.warmup is not None else (0.25 if a.quick else 0.5),
        reps=a.reps if a.reps is not None else (1 if a.quick else 2),
        tokens=a.tokens,
        cores=cores,
    )
    return plan, a.json


def main(argv: list[str] | None = None) -> int:
    plan, json_path = parse_args(argv)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        rows, raw_runs = run(plan, json_path.parent)
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    print(report(plan, rows))
    doc = {
        "plan": asdict(plan),
        "python": platform.python_version(),
        "summary": [asdict(r) for r in rows],
        "runs": raw_runs,
    }
    stats.write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
