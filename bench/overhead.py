"""`python -m bench.overhead`: what a router adds over a direct connection to the engines, for
Baton and, side by side in the same run, a bare aiohttp proxy (the floor: no Python router
can cost less) and the Rust routers sglang-router 0.3.2 and vllm-router 0.1.17.

Engines: `--replicas` (3) lean fake engines (bench/lean_engine.py: vLLM's API, answered as
fast as aiohttp can), so a router's cost is not hidden behind a slow engine. Targets: direct
(the load to one engine), Baton (control + shim, its default policy), the floor
(bench/floor_proxy.py), the floor + decider (the same proxy asking bench/floor_decider.py, a
second process, which engine for each request: the least Baton's design of one decision
process for all shims can cost) and the peers (bench/peers.py: installed on first use into
the bench's own virtualenv, `--peers none` to leave them out), all but Baton round robin;
every router spreads over all the engines.
A peer that cannot be installed or started is a `not run: why` line, and the rest runs.

Cores: the engines and the load generator share the first usable core, the router under test
gets the second (Baton: control and shim together), and every process is started on its core
so thread pools sized from the cores a process sees (the Rust routers' tokio workers) count
one. A machine with more cores runs the same layout on its first two and leaves the rest out
of the measurement: every column is a ratio to direct on that one engine core, so a router is
judged by what one core of it costs and delivers, the same on any machine. `--no-pin` lets the
scheduler decide.

Runs: per rep, every target gets non-streamed loads at c=1, 16 and 64 and 64-token streams at
c=1 and 64 (closed loop, a `bench.loadgen` child per run), the targets' order rotated from
cell to cell and rep to rep so drift hits them all. Reported per target, medians over reps:
added p50 at c=1, requests/s at c=16 and c=64 as a ratio to direct's, added streaming TTFT at
c=1, and the CPU of all of the router's processes (user + system time over the window) per
request at c=64 and per SSE event at c=64 (Baton's shim and control apart, and summed); then
Baton over the floor against issue 28's targets, as PASS/FAIL lines. Writes every run's raw
numbers and the summary as JSON. Benchmarks never gate: the exit status says only whether the
benchmark itself ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import overhead_table, peers, stats
from bench.cpu import Cores, children_pinned, plan_cores
from bench.parts import MODEL, control_argv, control_toml, serves_completion, shim_argv, starter
from clients.procs import Part

NONSTREAM_TOKENS = 8
DEFAULT_JSON = Path(__file__).parent / "results" / "overhead.json"


@dataclass(frozen=True, slots=True)
class Plan:
    replicas: int
    duration: float
    warmup: float
    reps: int
    stream_tokens: int
    pinned: bool
    peers: tuple[str, ...]  # keys of bench.peers.PEERS


@dataclass(frozen=True, slots=True)
class Target:
    """Where a load goes, and the router's processes behind it (none for direct): each one's
    CPU is read with everything under it."""

    name: str
    url: str
    parts: Mapping[str, int]  # process name -> pid


@dataclass(frozen=True, slots=True)
class Bench:
    targets: list[Target]
    not_run: dict[str, str]  # target -> why
    engines: Mapping[str, int]  # engine name -> pid
    cores: Cores | None


def await_serving(base: str, timeout: float = 15.0, model: str = MODEL) -> None:
    """Until `base` answers a completion with 200: control may still be probing its
    backends' health."""
    deadline = time.monotonic() + timeout
    while not serves_completion(base, model):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} did not serve a completion within {timeout}s")
        time.sleep(0.2)


@contextlib.contextmanager
def running_bench(plan: Plan, logdir: Path, cores: Cores | None) -> Iterator[Bench]:
    """Engines, then Baton, the floor and the peers in front of them; all stopped in reverse
    order on any exit, Ctrl-C included."""
    logdir.mkdir(parents=True, exist_ok=True)
    engine_core, router_core = (cores.engine, cores.baton) if cores else (None, None)
    with contextlib.ExitStack() as stack:

        logged = starter(stack, logdir, "overhead")

        def start(name: str, argv: list[str], on: set[int] | None) -> Part:
            with children_pinned(on):
                return logged(name, argv)

        engines = {f"e{i}": start(f"e{i}", ["bench.lean_engine", "--model", MODEL], engine_core)
                   for i in range(plan.replicas)}  # fmt: skip
        urls = [e.ready for e in engines.values()]
        config = logdir / "overhead.control.toml"
        config.write_text(control_toml(dict(zip(engines, urls, strict=True))))
        control = start("control", control_argv(str(config)), router_core)
        shim = start("shim", shim_argv(control.ready), router_core)
        await_serving(shim.ready)
        floor = start("floor", ["bench.floor_proxy", *(a for u in urls for a in ("--upstream", u))],
                      router_core)  # fmt: skip
        decider = start("decider", ["bench.floor_decider", "--upstreams", str(len(urls))],
                        router_core)  # fmt: skip
        decided = start("floor-decided",
                        ["bench.floor_proxy", "--decider", decider.ready,
                         *(a for u in urls for a in ("--upstream", u))], router_core)  # fmt: skip
        targets = [
            Target(overhead_table.DIRECT, urls[0], {}),
            Target(overhead_table.BATON, shim.ready, {"shim": shim.pid, "control": control.pid}),
            Target(overhead_table.FLOOR, floor.ready, {"floor": floor.pid}),
            Target(overhead_table.DECIDED, decided.ready,
                   {"proxy": decided.pid, "decider": decider.pid}),
        ]
        not_run: dict[str, str] = {}
        for key in plan.peers:
            peer = peers.PEERS[key]
            try:
                running = stack.enter_context(peers.running(peer, urls, logdir, router_core))
            except peers.NotRun as e:
                not_run[peer.label] = str(e)
                print(f"{peer.label}: not run: {e}", file=sys.stderr, flush=True)
                continue
            targets.append(Target(peer.label, running.url, {peer.package: running.pid}))
        yield Bench(targets, not_run, {n: e.pid for n, e in engines.items()}, cores)


def run_load(bench: Bench, plan: Plan, target: Target, mode: str, conc: int) -> dict[str, Any]:
    """One closed-loop run in a `bench.loadgen` child, pinned beside the engines; it reads the
    CPU of the engines and of the target's router processes over its window."""
    stream = mode == "stream"
    watched = {**bench.engines, **target.parts}
    argv = [
        sys.executable, "-m", "bench.loadgen", "--url", target.url,
        "--concurrency", str(conc), "--duration", str(plan.duration),
        "--warmup", str(plan.warmup), "--model", MODEL,
        "--max-tokens", str(plan.stream_tokens if stream else NONSTREAM_TOKENS),
        *(a for name, pid in watched.items() for a in ("--tree", f"{name}={pid}")),
    ]  # fmt: skip
    if stream:
        argv.append("--stream")
    if bench.cores is not None:
        argv += [a for core in sorted(bench.cores.engine) for a in ("--cpu", str(core))]
    raw = run_loadgen(argv, plan.warmup + plan.duration + 90, f"for {target.name} {mode} c={conc}")
    raw.update(target=target.name, mode=mode, concurrency=conc, router_parts=list(target.parts))
    return raw


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


def run_all(bench: Bench, plan: Plan) -> list[dict[str, Any]]:
    by_name = {t.name: t for t in bench.targets}
    runs: list[dict[str, Any]] = []
    for rep in range(plan.reps):
        for k, (mode, conc) in enumerate(overhead_table.CELLS):
            # Each cell starts one target further on, and each rep one further again.
            for name in stats.rotated(list(by_name), rep + k):
                raw = run_load(bench, plan, by_name[name], mode, conc)
                raw["rep"] = rep
                runs.append(raw)
                s = stats.run_stats(raw)
                print(f"  rep {rep} {mode:9} c={conc:<3} {name:22} {s.rps:8.0f} rps"
                      f"  p50 {s.p50_ms:7.3f} ms  ttft {s.ttft_p50_ms:7.3f} ms"
                      f"  errors {s.errors}", file=sys.stderr, flush=True)  # fmt: skip
    return runs


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="1 s per run, 1 rep")
    p.add_argument("--duration", type=float, help="seconds measured per run (default 3)")
    p.add_argument("--warmup", type=float, help="seconds before each window (default 0.5)")
    p.add_argument("--reps", type=int, help="repetitions (default 3)")
    p.add_argument("--replicas", type=int, default=3, help="lean engines behind the routers")
    p.add_argument("--stream-tokens", type=int, default=64, help="max_tokens when streaming")
    p.add_argument("--peers", default="sglang,vllm",
                   help=f"none, or a comma-separated list of {', '.join(peers.PEERS)}")  # fmt: skip
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    a = p.parse_args(argv)
    chosen = () if a.peers == "none" else tuple(k for k in a.peers.split(",") if k.strip())
    unknown = [k for k in chosen if k not in peers.PEERS]
    if unknown:
        p.error(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(peers.PEERS)})")
    plan = Plan(
        replicas=a.replicas,
        duration=a.duration if a.duration is not None else (1.0 if a.quick else 3.0),
        warmup=a.warmup if a.warmup is not None else (0.25 if a.quick else 0.5),
        reps=a.reps if a.reps is not None else (1 if a.quick else 3),
        stream_tokens=a.stream_tokens,
        pinned=not a.no_pin,
        peers=chosen,
    )
    return plan, a.json


def results_doc(
    plan: Plan, bench: Bench, table: list[overhead_table.Row], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    cores = bench.cores
    return {
        "plan": asdict(plan),
        "cores": None if cores is None else {"engine": sorted(cores.engine),
                                             "router": sorted(cores.baton)},  # fmt: skip
        "python": platform.python_version(),
        "targets": [{"name": t.name, "parts": list(t.parts)} for t in bench.targets],
        "not_run": bench.not_run,
        "summary": [asdict(r) for r in table],
        "checks": [{**asdict(t), "verdict": t.verdict} for t in overhead_table.checks(table)],
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    plan, json_path = parse_args(argv)
    # Read before anything starts: other work on the machine skews every column.
    load_before = os.getloadavg()[0]
    cores = plan_cores(plan.pinned)
    if plan.pinned and cores is None:
        print("fewer than 2 usable cores: running unpinned", file=sys.stderr)
    try:
        with running_bench(plan, json_path.parent, cores) as bench:
            runs = run_all(bench, plan)
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    table = overhead_table.rows(runs)
    print(overhead_table.render(table, bench.not_run))
    print(f"\nload average before the run: {load_before:.2f} ({os.cpu_count()} cores)")
    doc = {**results_doc(plan, bench, table, runs), "load_average_before": load_before}
    stats.write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
