"""`python -m bench.affinity`: the routing policies on two workloads that pull opposite ways.

Agent loop: K concurrent conversations of T streamed turns, 0-400 ms of tool time apart;
each turn re-sends the system prompt (shared by default: one agent product), every earlier
user turn (each carries a chunk of "file" text) and the replies verbatim. Kept on its card, a
turn re-prefills only its new chunk; moved, it re-prefills all that card has not seen.
Cold burst: N concurrent requests sharing a long system prompt, each with its own long text:
piled on the card that caches the system prompt, their prefills run one after another;
spread, on all cards at once.

Each (rep, policy) gets a fresh fleet (cold caches, no pins) of real processes: sims, control
with that policy, one shim. Policies interleave per rep, rotated so none always goes first.
Cost model (prefill dominates): 200 us per uncached prompt token (a turn's chunk of ~650
tokens ~130 ms, a burst member's own ~2000 tokens ~0.4 s, a late turn's whole context
~1.4 s), 5 ms per decode step, 16 reply tokens, a prefix cache nothing is evicted from.
Prints tables and PASS/FAIL lines (benchmarks never gate) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from random import Random
from typing import Any

import aiohttp
import orjson

from bench import stats
from bench.overhead import await_serving
from bench.parts import MODEL, control_argv, control_toml, shim_argv, sim_argv, starter
from clients.procs import Part

POLICIES = ("roundrobin", "affinity", "adaptive")
REASONS = ("spread", "pin-hit", "spill", "repin")
DEFAULT_JSON = Path(__file__).parent / "results" / "affinity.json"
# Code-review words: all get merged into few tokens (~2.7 tokens per word with the toy BPE).
VOCAB = tuple(
    "the request route stream cache engine fleet token model which would about there their "
    "when more time some into other than then these return value index buffer config handler "
    "session policy backend prefix reply turn agent state error retry health probe client "
    "server update delete create parse render table event metric latency window count list "
    "map key call test check read write open close start stop wait send".split()
)
Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class Plan:
    replicas: int = 2
    reps: int = 3
    conversations: int = 4
    turns: int = 8
    system_words: int = 400  # ~1060 tokens
    shared_system: bool = True  # False: each conversation its own (affinity then spreads them)
    chunk_words: int = 250  # ~650 tokens of file text per user turn
    # Tool time between turns, uniform in [0, tool_ms): real agents run tools, so their
    # conversations do not take turns in a fixed order. In lockstep the round-robin counter
    # advances by K between a conversation's turns, so with K a multiple of the replicas each
    # conversation would land on the same card every turn (K odd on two cards: never).
    tool_ms: float = 400.0
    burst: int = 16
    burst_words: int = 750  # ~2000 tokens of each burst member's own text
    max_tokens: int = 16
    prefill_us: float = 200.0
    decode_ms: float = 5.0
    seed: int = 0
    model: str = MODEL  # the sim's; bench/kv_real.py serves its own

    def sim_args(self) -> list[str]:
        return [
            "--prefill-us-per-token", str(self.prefill_us), "--decode-ms-per-step",
            str(self.decode_ms), "--cache-blocks", "65536", "--max-model-len", "200000",
        ]  # fmt: skip


QUICK = Plan(reps=2, turns=4, chunk_words=200, burst=8, burst_words=500)


# --- workload (pure) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    agent_systems: tuple[str, ...]  # [conversation]
    chunks: tuple[tuple[str, ...], ...]  # [conversation][turn]
    tool_s: tuple[tuple[float, ...], ...]  # [conversation][turn]: pause before that turn
    burst_system: str
    burst_users: tuple[str, ...]


def prose(rng: Random, words: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(words))


def make_workload(plan: Plan, seed: int) -> Workload:
    rng = Random(seed)
    system = "You are a coding agent. " + prose(rng, plan.system_words)
    systems = tuple(
        system if plan.shared_system else f"Agent {c}. " + prose(rng, plan.system_words)
        for c in range(plan.conversations)
    )
    chunks = tuple(
        tuple(prose(rng, plan.chunk_words) for _ in range(plan.turns))
        for _ in range(plan.conversations)
    )
    tool_s = tuple(
        tuple(0.0 if t == 0 else rng.uniform(0, plan.tool_ms) / 1e3 for t in range(plan.turns))
        for _ in range(plan.conversations)
    )
    # Its own system prompt: the burst must start cold even after the agent loop ran.
    burst_system = "You are a reviewer. " + prose(rng, plan.system_words)
    users = tuple(f"Review {i}: " + prose(rng, plan.burst_words) for i in range(plan.burst))
    return Workload(systems, chunks, tool_s, burst_system, users)


def turn_messages(system: str, chunks: Sequence[str], replies: Sequence[str]) -> list[Message]:
    """The next turn's request: system, then each user turn and its reply as received, ending
    with the newest user turn (so len(chunks) == len(replies) + 1)."""
    msgs = [{"role": "system", "content": system}]
    for i, chunk in enumerate(chunks):
        msgs.append({"role": "user", "content": f"Step {i + 1}, next part of the file:\n{chunk}"})
        if i < len(replies):
            msgs.append({"role": "assistant", "content": replies[i]})
    return msgs


# --- aggregation (pure) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    conv: int
    turn: int  # 1-based; turns >= 2 are warm (their prefix was served before)
    ttft_s: float
    request_id: str
    backend: str = ""
    reason: str = ""


def warm_ttfts_ms(turns: Sequence[Turn]) -> list[float]:
    return [t.ttft_s * 1e3 for t in turns if t.turn >= 2]


def moved_fraction(turns: Sequence[Turn]) -> float:
    """Warm turns served by a different backend than the conversation's previous turn: each
    re-prefills at least two turns' worth of context."""
    prev = {(t.conv, t.turn): t.backend for t in turns}
    warm = [t for t in turns if t.turn >= 2]
    moved = sum(prev.get((t.conv, t.turn - 1)) != t.backend for t in warm)
    return moved / len(warm) if warm else stats.NAN


@dataclass(frozen=True, slots=True)
class Rep:
    policy: str
    rep: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    hit_ratio: float  # agent loop: cached / queried prompt tokens, all sims
    moved: float
    burst_s: float
    burst_max_share: float  # largest fraction of the burst on one backend
    reasons: Mapping[str, Mapping[str, int]]  # workload -> reason -> count


def rep_result(
    policy: str, rep: int, turns: Sequence[Turn], cache: tuple[float, float],
    burst_s: float, burst_backends: Sequence[str], burst_reasons: Sequence[str],
) -> Rep:  # fmt: skip
    warm = warm_ttfts_ms(turns)
    hits, queries = cache
    return Rep(
        policy, rep, stats.percentile(warm, 50), stats.percentile(warm, 90),
        hits / queries if queries else stats.NAN, moved_fraction(turns), burst_s,
        stats.largest_share(burst_backends),
        {"agent": dict(Counter(t.reason for t in turns)), "burst": dict(Counter(burst_reasons))},
    )  # fmt: skip


def summarize(reps: Sequence[Rep]) -> dict[str, Rep]:
    """Per policy (first-seen order): the median of each number across reps (rep = -1) and
    the route reasons summed over reps."""
    out: dict[str, Rep] = {}
    for policy in dict.fromkeys(r.policy for r in reps):
        rs = [r for r in reps if r.policy == policy]
        reasons: dict[str, Counter[str]] = {"agent": Counter(), "burst": Counter()}
        for r in rs:
            for workload, counts in r.reasons.items():
                reasons.setdefault(workload, Counter()).update(counts)
        medians = {f: stats.median(getattr(r, f) for r in rs) for f in _NUMBERS}
        out[policy] = Rep(policy, -1, **medians, reasons={w: dict(c) for w, c in reasons.items()})
    return out


_NUMBERS = ("ttft_p50_ms", "ttft_p90_ms", "hit_ratio", "moved", "burst_s", "burst_max_share")


def targets(summary: Mapping[str, Rep]) -> list[stats.Target]:
    """The issue's targets (adaptive within 5% of the best policy on each workload) and the
    expected pattern (each one-sided policy clearly slower on the workload it gets wrong)."""
    agent = {p: s.ttft_p50_ms for p, s in summary.items()}
    burst = {p: s.burst_s for p, s in summary.items()}
    return [
        stats.Target("adaptive/best warm-turn TTFT p50", _over_best(agent, "adaptive"), 1.05),
        stats.Target("adaptive/best burst total time", _over_best(burst, "adaptive"), 1.05),
        stats.Target(
            "pattern: roundrobin/best other, warm-turn TTFT p50 (turns moved off their cache)",
            _over_best(agent, "roundrobin", others=True), 1.25, higher_is_better=True,
        ),
        stats.Target(
            "pattern: affinity/best other, burst total time (the burst piled on one card)",
            _over_best(burst, "affinity", others=True), 1.25, higher_is_better=True,
        ),
    ]  # fmt: skip


def _over_best(values: Mapping[str, float], policy: str, *, others: bool = False) -> float:
    """`policy`'s value over the best (smallest) one, or with `others` over the best of the
    other policies (a policy run alone shows no pattern). NaN when not measured."""
    pool = [v for p, v in values.items() if not math.isnan(v) and not (others and p == policy)]
    best = min(pool, default=stats.NAN)
    return values.get(policy, stats.NAN) / best if best > 0 else stats.NAN


HEADERS = (
    "policy", "ttft p50 ms", "ttft p90 ms", "p50/best", "hit %", "moved %",
    "burst s", "burst/best", "max/card %",
)  # fmt: skip


def table(summary: Mapping[str, Rep]) -> str:
    agent = stats.ratio_to_best({p: s.ttft_p50_ms for p, s in summary.items()})
    burst = stats.ratio_to_best({p: s.burst_s for p, s in summary.items()})
    rows = [
        [
            p, stats.fmt(s.ttft_p50_ms, 1), stats.fmt(s.ttft_p90_ms, 1), stats.fmt(agent[p]),
            stats.fmt(s.hit_ratio * 100, 1), stats.fmt(s.moved * 100, 0),
            stats.fmt(s.burst_s), stats.fmt(burst[p]), stats.fmt(s.burst_max_share * 100, 0),
        ]
        for p, s in summary.items()
    ]  # fmt: skip
    return stats.render_table(HEADERS, rows)


def reason_table(summary: Mapping[str, Rep]) -> str:
    rows = []
    for p, s in summary.items():
        for workload, counts in s.reasons.items():
            other = sum(n for r, n in counts.items() if r not in REASONS)
            rows.append([f"{p} {workload}", *(str(counts.get(r, 0)) for r in REASONS), str(other)])
    return stats.render_table(("policy workload", *REASONS, "other"), rows)


# --- processes and clients -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fleet:
    sims: tuple[Part, ...]
    control: Part
    shim: Part


@contextlib.contextmanager
def running_fleet(plan: Plan, policy: str, logdir: Path) -> Iterator[Fleet]:
    """Fresh sims (cold caches), control with `policy` (no pins), one shim; all stopped in
    reverse order on any exit, Ctrl-C included."""
    logdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:

        start = starter(stack, logdir, "affinity")

        sims = tuple(
            start(f"sim{i}", sim_argv("127.0.0.1:0", *plan.sim_args()))
            for i in range(plan.replicas)
        )
        config = logdir / "affinity.control.toml"
        config.write_text(
            control_toml({f"s{i}": s.ready for i, s in enumerate(sims)}, routing=policy)
        )
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        await_serving(shim.ready)
        yield Fleet(sims, control, shim)


def cache_counters(sims: Sequence[Part]) -> tuple[float, float]:
    """(hit, queried) prompt tokens of the whole fleet, from the sims' vLLM metrics."""
    texts = [urllib.request.urlopen(s.ready + "/metrics", timeout=10).read().decode() for s in sims]
    return (
        sum(stats.metric_sum(t, "vllm:prefix_cache_hits_total") for t in texts),
        sum(stats.metric_sum(t, "vllm:prefix_cache_queries_total") for t in texts),
    )


def route_events(control: str) -> dict[str, tuple[str, str]]:
    """request id -> (backend, reason) from control's audit log, through the real CLI."""
    argv = [sys.executable, "-m", "clients.cli", "events", "--kind", "route", "--json",
            "--control", control, "--limit", "100000"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return {e["request_id"]: (e["backend_id"], e["reason"]) for e in json.loads(out.stdout)}


async def chat(
    session: aiohttp.ClientSession, base: str, msgs: list[Message], plan: Plan, stream: bool
) -> tuple[float, str, str]:
    """(TTFT s: first content byte, or the whole reply when not streaming; reply; request id)."""
    body = {"model": plan.model, "messages": msgs, "max_tokens": plan.max_tokens, "temperature": 0,
            "stream": stream}  # fmt: skip
    t0 = time.perf_counter()
    async with session.post(base + "/v1/chat/completions", data=orjson.dumps(body)) as resp:
        resp.raise_for_status()
        rid = resp.headers.get("X-Request-Id", "")
        if not stream:
            reply = orjson.loads(await resp.read())["choices"][0]["message"]["content"]
            return time.perf_counter() - t0, reply, rid
        ttft, parts = stats.NAN, list[str]()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue  # blank separators and [DONE]
            choices = orjson.loads(line[6:]).get("choices") or [{}]
            text = (choices[0].get("delta") or {}).get("content")
            if text:
                ttft = time.perf_counter() - t0 if not parts else ttft
                parts.append(text)
    if not parts:
        raise RuntimeError(f"request {rid}: stream ended without content")
    return ttft, "".join(parts), rid


def _session() -> aiohttp.ClientSession:
    # One session per workload, not per request; every request is bounded in time.
    json_type = {"Content-Type": "application/json"}
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), headers=json_type)


async def agent_loop(base: str, plan: Plan, wl: Workload) -> list[Turn]:
    async with _session() as session:

        async def conversation(c: int) -> list[Turn]:
            replies: list[str] = []
            out = []
            for t in range(plan.turns):
                await asyncio.sleep(wl.tool_s[c][t])
                msgs = turn_messages(wl.agent_systems[c], wl.chunks[c][: t + 1], replies)
                ttft, reply, rid = await chat(session, base, msgs, plan, stream=True)
                replies.append(reply)  # verbatim, as an agent framework would
                out.append(Turn(c, t + 1, ttft, rid))
            return out

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(conversation(c)) for c in range(plan.conversations)]
    return [t for task in tasks for t in task.result()]


async def cold_burst(base: str, plan: Plan, wl: Workload) -> tuple[float, list[str]]:
    """(first send -> last completion, s; request ids)."""
    system = {"role": "system", "content": wl.burst_system}
    async with _session() as session:
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(chat(session, base, [system, {"role": "user", "content": u}],
                                         plan, stream=False)) for u in wl.burst_users]  # fmt: skip
        wall = time.perf_counter() - t0
    return wall, [task.result()[2] for task in tasks]


def run_rep(plan: Plan, policy: str, rep: int, logdir: Path) -> tuple[Rep, dict[str, Any]]:
    wl = make_workload(plan, plan.seed + rep)  # the same workload for every policy in a rep
    with running_fleet(plan, policy, logdir) as fleet:
        before = cache_counters(fleet.sims)
        turns = asyncio.run(agent_loop(fleet.shim.ready, plan, wl))
        after = cache_counters(fleet.sims)
        burst_s, rids = asyncio.run(cold_burst(fleet.shim.ready, plan, wl))
        events = route_events(fleet.control.ready)
    turns = [replace(t, backend=events.get(t.request_id, ("", ""))[0],
                     reason=events.get(t.request_id, ("", ""))[1]) for t in turns]  # fmt: skip
    burst_events = [events.get(r, ("", "")) for r in rids]
    cache = (after[0] - before[0], after[1] - before[1])
    result = rep_result(
        policy, rep, turns, cache, burst_s,
        [b for b, _ in burst_events], [r for _, r in burst_events],
    )  # fmt: skip
    raw = {"policy": policy, "rep": rep, "turns": [asdict(t) for t in turns],
           "burst": [{"request_id": r, "backend": b, "reason": why}
                     for r, (b, why) in zip(rids, burst_events, strict=True)]}  # fmt: skip
    return result, raw


def report(summary: Mapping[str, Rep]) -> str:
    return "\n".join([
        table(summary),
        "",
        "ttft = warm turns (>= 2) of the agent loop, first content byte at the client; hit % =",
        "prefix-cache hits / queried prompt tokens (agent loop); moved % = warm turns on another",
        "backend than the previous turn; burst s = first send -> last completion; max/card % =",
        "largest share of the burst on one backend. Medians across reps.",
        "",
        "Route reasons (summed over reps):",
        reason_table(summary),
        "",
        *stats.target_lines(targets(summary)),
    ])  # fmt: skip


def parse_args(argv: list[str] | None) -> tuple[Plan, list[str], Path]:
    p = argparse.ArgumentParser(
        prog="python -m bench.affinity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="4 turns, burst of 8, 2 reps")
    p.add_argument("--replicas", type=int, default=2, help="sims in each fleet")
    p.add_argument("--reps", type=int, help="fresh fleets per policy (default 3; quick 2)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    p.add_argument("--seed", type=int, default=0, help="workload of rep r: seed + r")
    p.add_argument("--tool-ms", type=float, help="max tool time between turns (default 400)")
    p.add_argument("--own-system", action="store_true", help="a system prompt per conversation")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    a = p.parse_args(argv)
    plan = replace(QUICK if a.quick else Plan(), replicas=a.replicas, seed=a.seed,
                   shared_system=not a.own_system)  # fmt: skip
    plan = plan if a.reps is None else replace(plan, reps=a.reps)
    plan = plan if a.tool_ms is None else replace(plan, tool_ms=a.tool_ms)
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    return plan, policies, a.json


def main(argv: list[str] | None = None) -> int:
    plan, policies, json_path = parse_args(argv)
    load = {"before": os.getloadavg()[0]}
    reps: list[Rep] = []
    raw: list[dict[str, Any]] = []
    try:
        for rep in range(plan.reps):
            # Rep r starts with policy r: drift (another job, thermal) hits each in turn.
            for policy in stats.rotated(policies, rep):
                result, doc = run_rep(plan, policy, rep, json_path.parent)
                reps.append(result)
                raw.append(doc)
                print(f"  rep {rep} {policy:10} ttft p50 {result.ttft_p50_ms:7.1f} ms  "
                      f"burst {result.burst_s:5.2f} s", file=sys.stderr, flush=True)  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    load["after"] = os.getloadavg()[0]
    summary = summarize(reps)
    summary = {p: summary[p] for p in policies if p in summary}
    print(report(summary))
    print(f"\n1-min load average: {load['before']:.2f} before, {load['after']:.2f} after")
    doc = {"plan": asdict(plan), "load": load,
           "summary": {p: asdict(s) for p, s in summary.items()},
           "targets": [{**asdict(t), "verdict": t.verdict} for t in targets(summary)],
           "reps": [asdict(r) for r in reps], "raw": raw}  # fmt: skip
    stats.write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
