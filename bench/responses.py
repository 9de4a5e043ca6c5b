"""`python -m bench.responses`: the Responses API and Anthropic's Messages API through Baton
against the same sim direct, in one run, and the failover gap of their streams next to
chat's.

Phase 1 (overhead), one sim with its cost model zeroed, control and a shim as real processes
(the sim and the load generator on one core, Baton on another): closed-loop loads of
`POST /v1/responses` direct to the sim and through the shim, alternating which goes first per
rep, for
- `stored`: whole answers with `store: true`, relayed from the engine's own /v1/responses (the
  shim records each response's owner with control before answering);
- `stream`: `store: false` streams, which the shim serves as chat and writes as Responses
  events (the path that can fail over);
- `messages`: whole Anthropic messages, relayed from the engine's own /v1/messages;
- `messages-stream`: Messages streams, which the shim serves as chat and writes as Anthropic
  events (the path that can fail over);
- `chat-stream`: the same prompt as a chat stream, for reference.
Reported: added latency p50 at c=1, TTFT p50 at c=1, requests/s at c=16 (ratio to direct).

Phase 2 (failover gap), three sims with the default cost model; s0 drops every stream after
`--die-after` tokens (`--fault die-after=N`), so the requests control sends there fail over
mid-stream. Chat, `store: false` Responses and Messages streams, shuffled, go one at a time;
each failover's gap comes from control's audit events, matched to its request by the
X-Request-Id header.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import stats
from bench.cpu import Cores, pin, plan_cores
from bench.loadgen import PATHS, request_body
from bench.overhead import await_serving, run_loadgen
from bench.parts import MODEL, control_argv, control_toml, shim_argv, sim_argv, starter
from clients.procs import Part

DEFAULT_JSON = Path(__file__).parent / "results" / "responses.json"
MODES = {  # mode -> (endpoint, stream, store, tokens)
    "stored": ("responses", False, True, 8),
    "stream": ("responses", True, False, 32),
    "messages": ("messages", False, False, 8),
    "messages-stream": ("messages", True, False, 32),
    "chat-stream": ("chat", True, False, 32),
}
KINDS = ("chat", "responses", "messages")  # the streams of the failover phase
# How a complete stream of each kind ends, and what ends a failed one.
ENDS = {"chat": b"data: [DONE]", "responses": b"event: response.completed",
        "messages": b"event: message_stop"}  # fmt: skip
FAILED = (b"event: response.failed", b'{"error"', b"event: error")
PROMPT = "Explain what a router in front of a fleet of inference engines does."
# The sim's cost model zeroed: any time measured is software, the engine's and Baton's.
SIM_ARGS = ("--prefill-us-per-token", "0", "--decode-ms-per-step", "0")


@dataclass(frozen=True, slots=True)
class Plan:
    concurrency: tuple[int, ...]
    duration: float
    warmup: float
    reps: int


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

        start = starter(stack, logdir, "responses.overhead")

        sim = start("sim", sim_argv("127.0.0.1:0", *SIM_ARGS))
        config = logdir / "responses.overhead.control.toml"
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


def load(system: System, plan: Plan, target: str, mode: str, conc: int) -> dict[str, Any]:
    endpoint, stream, store, tokens = MODES[mode]
    argv = [
        sys.executable, "-m", "bench.loadgen", "--url", system.url(target),
        "--endpoint", endpoint, "--concurrency", str(conc), "--duration", str(plan.duration),
        "--warmup", str(plan.warmup), "--model", MODEL, "--max-tokens", str(tokens),
        "--prompt", PROMPT,
        "--pid", f"sim={system.sim.proc.pid}", "--pid", f"shim={system.shim.proc.pid}",
        "--pid", f"control={system.control.proc.pid}",
    ]  # fmt: skip
    if stream:
        argv.append("--stream")
    if store:
        argv.append("--store")
    if system.cores is not None:
        argv += [a for core in sorted(system.cores.engine) for a in ("--cpu", str(core))]
    return run_loadgen(argv, plan.warmup + plan.duration + 90, f"{target} {mode} c={conc}")


def overhead(system: System, plan: Plan) -> list[dict[str, Any]]:
    runs = []
    for mode in MODES:
        for conc in plan.concurrency:
            for rep in range(plan.reps):
                order = ("direct", "baton") if rep % 2 == 0 else ("baton", "direct")
                for target in order:
                    raw = load(system, plan, target, mode, conc)
                    raw.update(target=target, mode=mode, concurrency=conc, rep=rep)
                    runs.append(raw)
                    s = stats.run_stats(raw)
                    print(f"  {mode:11} c={conc:<3} rep {rep} {target:6} {s.rps:8.0f} rps  "
                          f"p50 {s.p50_ms:7.3f} ms  errors {s.errors}",
                          file=sys.stderr, flush=True)  # fmt: skip
    return runs


@contextlib.contextmanager
def dying_fleet(logdir: Path, die_after: int) -> Iterator[tuple[Part, Part]]:
    """Three sims (s0 drops every stream after `die_after` tokens), control, a shim."""
    with contextlib.ExitStack() as stack:

        start = starter(stack, logdir, "responses")

        faults = {"s0": ("--fault", f"die-after={die_after}")}
        sims = {k: start(k, sim_argv("127.0.0.1:0", *faults.get(k, ())))
                for k in ("s0", "s1", "s2")}  # fmt: skip
        config = logdir / "responses.control.toml"
        config.write_text(control_toml({k: p.ready for k, p in sims.items()}, probe_interval=0.2))
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        await_serving(shim.ready)
        yield control, shim


def one_stream(base: str, endpoint: str, tokens: int) -> tuple[str, bool]:
    """One stream to its end: its request id, and whether it ended as a complete answer."""
    body = request_body(endpoint, MODEL, PROMPT, tokens, True, False)
    req = urllib.request.Request(base + PATHS[endpoint], data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as resp:
        data = resp.read()
        rid = resp.headers.get("X-Request-Id", "")
    failed = any(m in data for m in FAILED)
    return rid, ENDS[endpoint] in data and not failed


def gaps(logdir: Path, requests: int, die_after: int, seed: int = 0) -> dict[str, Any]:
    kinds: dict[str, str] = {}
    sent = dict.fromkeys(KINDS, 0)
    complete = dict.fromkeys(KINDS, 0)
    # Shuffled, not alternating: the spread ring and s0's demotions have a rhythm, and a
    # fixed alternation can hand every stream of one kind the dying card, or none.
    order = list(KINDS) * (requests // len(KINDS))
    random.Random(seed).shuffle(order)
    with dying_fleet(logdir, die_after) as (control, shim):
        for endpoint in order:
            rid, ok = one_stream(shim.ready, endpoint, 48)
            kinds[rid] = endpoint
            sent[endpoint] += 1
            complete[endpoint] += ok
        events = failover_events(control)
    by_kind: dict[str, list[float]] = {k: [] for k in KINDS}
    outcomes: dict[str, dict[str, int]] = {k: {} for k in KINDS}
    for e in events:
        kind = kinds.get(e["request_id"])
        if kind is None:
            continue
        outcomes[kind][e["outcome"]] = outcomes[kind].get(e["outcome"], 0) + 1
        if e["outcome"] == "resumed":
            by_kind[kind].append(float(e["gap_ms"]))
    return {
        kind: {"streams": sent[kind], "complete": complete[kind], "failovers": outcomes[kind],
               "gap_ms": {"p50": stats.percentile(v, 50), "p90": stats.percentile(v, 90)}}
        for kind, v in by_kind.items()
    }  # fmt: skip


def failover_events(control: Part) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", "events", "--kind", "failover", "--json",
         "--control", control.ready],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    events: list[dict[str, Any]] = json.loads(out.stdout)
    return events


def report(cells: list[stats.Cell], gap: dict[str, Any]) -> str:
    by = {(c.mode, c.concurrency): c for c in cells}
    rows = []
    for mode in MODES:
        one, many = by.get((mode, 1)), by.get((mode, 16))
        rows.append([
            mode,
            stats.fmt(one.direct.p50_ms, 3) if one else "-",
            stats.fmt(one.added_p50_ms, 3) if one else "-",
            stats.fmt(one.direct.ttft_p50_ms, 3) if one else "-",
            stats.fmt(one.baton.ttft_p50_ms, 3) if one else "-",
            stats.fmt(many.direct.rps, 0) if many else "-",
            stats.fmt(many.baton.rps, 0) if many else "-",
            stats.fmt(many.ratio, 3) if many else "-",
        ])  # fmt: skip
    headers = ["mode", "d p50 c=1", "added p50", "d ttft c=1", "b ttft c=1", "d rps c=16",
               "b rps c=16", "ratio"]  # fmt: skip
    gap_rows = [[k, str(v["streams"]), str(v["complete"]), json.dumps(v["failovers"]),
                 stats.fmt(v["gap_ms"]["p50"], 2), stats.fmt(v["gap_ms"]["p90"], 2)]
                for k, v in gap.items()]  # fmt: skip
    return "\n".join([
        stats.render_table(headers, rows),
        "d = direct to the sim, b = through Baton; ms; medians across reps.",
        "",
        "Failover gap, chat, Responses and Messages streams (shuffled) in the same run:",
        stats.render_table(["stream", "sent", "complete", "failovers", "gap p50 ms",
                            "gap p90 ms"], gap_rows),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.responses", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="1 s per run, 1 rep, 40 gap streams")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--requests", type=int, default=120, help="phase 2 streams")
    p.add_argument("--die-after", type=int, default=12)
    p.add_argument("--seed", type=int, default=0, help="phase 2's order of chat and Responses")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    quick = args.quick
    plan = Plan((1, 16), 1.0 if quick else args.duration, 0.25 if quick else 0.5,
                1 if quick else args.reps)  # fmt: skip
    logdir = args.json.parent
    logdir.mkdir(parents=True, exist_ok=True)
    cores = plan_cores(True)
    with running_system(logdir, cores) as system:
        runs = overhead(system, plan)
    gap = gaps(logdir, 40 if quick else args.requests, args.die_after, args.seed)
    cells = stats.summarize(runs)
    print(report(cells, gap))
    doc = {"plan": {"reps": plan.reps, "duration": plan.duration, "die_after": args.die_after},
           "cells": [{"mode": c.mode, "concurrency": c.concurrency, "ratio": c.ratio,
                      "added_p50_ms": c.added_p50_ms, "added_ttft_p50_ms": c.added_ttft_p50_ms,
                      "direct": asdict(c.direct), "baton": asdict(c.baton)}
                     for c in cells],
           "gap": gap, "runs": runs}  # fmt: skip
    args.json.write_text(json.dumps(stats.finite(doc), allow_nan=False, default=str))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
