"""`python -m bench.failover`: streams through Baton while backends are SIGKILLed mid-stream.

B sims (default cost model, so a 64-token stream lasts ~0.35 s and can be killed mid-way), one
control and one shim run as real processes (bench/chaos_fleet.py). Phases, in one run:

1. Reference: each prompt's uninterrupted greedy completion, non-streaming, from sim s0, with
   its prompt and generated token ids. Every client stream is checked byte-identical to it.
2. No-kill overhead: N/4 streams direct (round robin over the sims, so each sim carries the same
   batch as behind the shim), then N/4 through the shim, both at concurrency C.
3. Chaos: N streams through the shim at concurrency C while a sim is SIGKILLed every ~kill-every
   seconds and restarted on its old port 0.1-0.5 s later (never leaving no settled sim). Sims
   are forked from a warm parent (bench/sim_zygote.py): a cold `python -m sim` start burns
   ~0.7 CPU-s, which at this kill rate took about a core of the 2-core machine from the
   router being measured, and none from the floor phases.
4. Engine floor: every sim logs its own TTFT per request (`--timing-log`); each resume is found
   in its new backend's log by its exact prompt ids, so the floor of that failover is what the
   engine itself needed, at that moment and under that load (the kill's other resumes queued on
   the same card included). Gap / engine floor is what Baton adds on top of the physics.
5. Floor (also replayed per kill: the resumes of one kill that landed on one card, sent to
   the idle sim together, since a card prefills them one after another; both are reported):
   for up to FLOOR_SAMPLES resumed failovers, the TTFT of one direct stream whose prompt
   is that request's prompt ids + the `tokens_sent` reference ids, i.e. exactly what the resume
   had to prefill. Measured after the load, one at a time, on a separate sim of the same cost
   model with its prefix cache OFF: each sample pays its full prefill (at most ~1.6 ms here), the
   most a resume target could pay, with no batch and no CPU contention. Its TTFT includes the
   client's HTTP round trip; the shim's gap includes its own hops and the stitching (control
   is told of the failure once the resumed stream flows, after the gap).
6. Floor under load: each kill's resumes sent together, directly, to the backend that took them,
   while the same closed-loop load as the chaos phase runs through the shim (so the machine is
   as busy as it was): the strictest of the floors.

Prints a table and PASS/FAIL lines (benchmarks never gate) and writes JSON: the summary, every
client record, failover event, kill and restart, for a breakdown after the fact. "machine CPU
busy" is the fraction of all cores busy during a phase, whoever used them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from random import Random
from typing import Any

import aiohttp

from bench import agent_failover, stats
from bench.chaos_fleet import (
    Fleet,
    KillLog,
    StreamRecord,
    busy_fraction,
    chaos,
    chaos_schedule,
    failover_events,
    load,
    machine_busy,
    stream_one,
)
from bench.overhead import await_serving
from bench.parts import MODEL
from sim.timing import prompt_key

DEFAULT_JSON = Path(__file__).parent / "results" / "failover.json"
FLOOR_SAMPLES = 50
WORKLOADS = ("completions", "agent")
WORDS = (
    "amber river quietly stone north lantern maple orbit velvet harbor cinder meadow "
    "falcon copper thistle glacier echo saffron willow beacon ember prism tundra"
).split()


@dataclass(frozen=True, slots=True)
class Reference:
    prompt: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    # Token counts k after which the engine held text back (the k-th token's chunk carried no
    # text): a cut there ends the resume's prompt mid-character.
    held: frozenset[int] = frozenset()


def make_prompts(seed: int, count: int) -> list[str]:
    rng = Random(seed)
    return [" ".join(rng.sample(WORDS, rng.randint(3, 6))) for _ in range(count)]


# -- pure aggregation -----------------------------------------------------------------------------
def kill_groups(
    events: Sequence[Mapping[str, Any]], window: float = 0.05
) -> list[list[Mapping[str, Any]]]:
    """Resumed failovers that hit the same backend within `window` seconds of each other:
    the streams of one kill, whose resume prefills that card had to do at the same time."""
    groups: list[list[Mapping[str, Any]]] = []
    resumed = sorted((e for e in events if e.get("outcome") == "resumed"), key=lambda e: e["time"])
    for e in resumed:
        last = groups[-1] if groups else None
        if (
            last
            and e["to_backend"] == last[0]["to_backend"]
            and e["time"] - last[0]["time"] < window
        ):
            last.append(e)
        else:
            groups.append([e])
    return groups


def summarize(
    records: Sequence[StreamRecord],
    refs: Sequence[Reference],
    events: Sequence[Mapping[str, Any]],
    floors_ms: Sequence[float],
    kills: Sequence[tuple[float, str]],
    together_ms: Sequence[float] = (),
    engine: Sequence[tuple[float, float]] = (),
    loaded_ms: Sequence[float] = (),
) -> dict[str, Any]:
    """Everything the report prints, from raw records; no I/O. `engine`: (gap ms, the new
    backend's own TTFT ms for that resume) per failover whose resume the engine logged."""
    verdicts = Counter(r.verdict for r in records)
    completed = [r for r in records if r.verdict == "completed"]
    differs = [r for r in completed if r.text != refs[r.prompt].text]
    resumed = [e for e in events if e.get("outcome") == "resumed"]
    prompt_of = {r.rid: r.prompt for r in records}
    gaps = [float(e["gap_ms"]) for e in resumed]
    gap50, floor50 = stats.percentile(gaps, 50), stats.percentile(floors_ms, 50)
    return {
        "requests": len(records),
        "completed": verdicts["completed"],
        "failed": verdicts["failed"],
        "truncated": verdicts["truncated"],
        "identical_pct": 100 * (1 - len(differs) / len(completed)) if completed else stats.NAN,
        "non_identical": [difference(r, refs[r.prompt].text) for r in differs],
        "bad_streams": [bad_stream(r, events) for r in records if r.verdict != "completed"],
        "failovers": len(events),
        "by_outcome": dict(Counter(str(e.get("outcome")) for e in events)),
        "by_seam": dict(Counter(str(e.get("seam") or "-") for e in events)),
        "mid_character": sum(
            1 for e in resumed
            if (r := prompt_of.get(str(e.get("request_id")))) is not None
            and int(e["tokens_sent"]) in refs[r].held
        ),
        "by_failure": dict(Counter(str(e.get("failure")) for e in events)),
        "gap_ms": stats.p50_p99(gaps),
        "floor_ms": stats.p50_p99(floors_ms),
        "floor_samples": len(floors_ms),
        "gap_over_floor": gap50 / floor50 if floor50 > 0 else stats.NAN,
        "floor_together_ms": stats.p50_p99(together_ms),
        "gap_over_floor_together": (
            gap50 / stats.percentile(together_ms, 50) if together_ms else stats.NAN
        ),
        "floor_loaded_ms": stats.p50_p99(loaded_ms),
        "gap_over_floor_loaded": (
            gap50 / stats.percentile(loaded_ms, 50) if loaded_ms else stats.NAN
        ),
        **engine_floor(engine),
        **seam_timing(records, events, kills),
        "kills": len(kills),
    }


def engine_floor(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """The physical floor measured inside the run: what the backend that took each resume
    needed itself to produce its first token (queueing behind the kill's other resumes and its
    own load included), next to the gap the client saw for the same failovers."""
    gaps = [g for g, _ in pairs]
    floors = [f for _, f in pairs]
    floor50 = stats.percentile(floors, 50)
    return {
        "engine_floor_samples": len(pairs),
        "engine_floor_ms": stats.p50_p99(floors),
        "engine_matched_gap_ms": stats.p50_p99(gaps),
        "gap_over_engine_floor": (
            stats.percentile(gaps, 50) / floor50 if pairs and floor50 > 0 else stats.NAN
        ),
        "baton_added_ms": stats.p50_p99([g - f for g, f in pairs]),
    }


def engine_ttfts(
    events: Sequence[Mapping[str, Any]],
    rids: Mapping[str, StreamRecord],
    refs: Sequence[Reference],
    logs: Mapping[str, Sequence[Mapping[str, Any]]],
) -> list[tuple[float, float]]:
    """(gap, engine TTFT) for each resumed failover whose resume request is in its target's
    timing log, matched by the exact prompt ids the resume sent. A prompt resumed twice at the
    same point on the same backend is ambiguous and skipped."""
    by_key: dict[tuple[str, str], list[float]] = {}
    for sid, lines in logs.items():
        for line in lines:
            by_key.setdefault((sid, str(line["prompt"])), []).append(float(line["ttft_ms"]))
    out = []
    for e in events:
        rec = rids.get(str(e.get("request_id")))
        if e.get("outcome") != "resumed" or rec is None:
            continue
        ref = refs[rec.prompt]
        key = prompt_key([*ref.prompt_ids, *ref.token_ids[: int(e["tokens_sent"])]])
        found = by_key.get((str(e["to_backend"]), key), [])
        if len(found) == 1:
            out.append((float(e["gap_ms"]), found[0]))
    return out


def bad_stream(r: StreamRecord, events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Evidence for a stream the client saw fail: what it got and the failovers behind it."""
    mine = [e for e in events if e.get("request_id") == r.rid]
    return {"rid": r.rid, "verdict": r.verdict, "status": r.status, "error": r.error[:300],
            "tokens": len(r.arrivals), "failovers": mine}  # fmt: skip


def difference(r: StreamRecord, want: str) -> dict[str, Any]:
    """Where a stream first differs from the reference, with a little context either side."""
    at = next((i for i, (a, b) in enumerate(zip(r.text, want, strict=False)) if a != b), None)
    at = min(len(r.text), len(want)) if at is None else at
    lo = max(0, at - 20)
    return {"rid": r.rid, "prompt": r.prompt, "at_char": at,
            "got": r.text[lo : at + 20], "want": want[lo : at + 20]}  # fmt: skip


def seam_timing(
    records: Sequence[StreamRecord],
    events: Sequence[Mapping[str, Any]],
    kills: Sequence[tuple[float, str]],
    window_s: float = 1.0,
) -> dict[str, dict[str, float]]:
    """What the client saw at each resumed seam (ms): the wait between the last token from the
    old backend and the first resumed one (`seam_stall_ms`), and the time from the SIGKILL of
    the old backend to that first resumed token (`kill_to_resume_ms`; kills more than
    `window_s` earlier are not this seam's). The shim's gap starts when it noticed the
    failure, so kill_to_resume minus gap is detection plus delivery."""
    by_rid = {r.rid: r for r in records}
    stalls, since_kill = [], []
    for e in events:
        r, k = by_rid.get(e.get("request_id", "")), int(e.get("tokens_sent", 0))
        if r is None or e.get("outcome") != "resumed" or len(r.arrivals) <= k:
            continue
        if k > 0:
            stalls.append((r.arrivals[k] - r.arrivals[k - 1]) * 1e3)
        at = r.start + r.arrivals[k]
        before = [t for t, sid in kills if sid == e.get("from_backend") and t <= at]
        if before and at - max(before) <= window_s:
            since_kill.append((at - max(before)) * 1e3)
    return {"seam_stall_ms": stats.p50_p99(stalls), "kill_to_resume_ms": stats.p50_p99(since_kill)}


def overhead(direct: Sequence[StreamRecord], baton: Sequence[StreamRecord]) -> dict[str, Any]:
    def side(rs: Sequence[StreamRecord]) -> dict[str, float]:
        ok = [r for r in rs if r.verdict == "completed" and r.arrivals]
        return {
            "ttft_p50": stats.percentile([r.arrivals[0] for r in ok], 50) * 1e3,
            "total_p50": stats.percentile([r.end - r.start for r in ok], 50) * 1e3,
            "errors": len(rs) - len(ok),
        }

    return {"direct": side(direct), "baton": side(baton)}


def targets(s: Mapping[str, Any]) -> list[stats.Target]:
    return [
        stats.Target("client-visible errors + truncated streams", s["failed"] + s["truncated"], 0),
        stats.Target("byte-identical % of completed", s["identical_pct"], 100, True),
        stats.Target("failover gap p50 / floor p50", s["gap_over_floor"], 1.5),
        stats.Target(
            "failover gap p50 / floor p50 with a kill's resumes replayed together",
            s["gap_over_floor_together"],
            1.5,
        ),
        stats.Target(
            "failover gap p50 / floor p50: the same resumes sent directly, together, to the same "
            "backend under the run's load",
            s["gap_over_floor_loaded"],
            1.5,
        ),
    ]


def report(s: Mapping[str, Any], o: Mapping[str, Any], busy: Mapping[str, float]) -> str:
    def counts(d: Mapping[str, int]) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"

    def p50_99(d: Mapping[str, float]) -> str:
        return f"{stats.fmt(d['p50'])} / {stats.fmt(d['p99'])}"

    def vs(key: str) -> str:
        return f"{stats.fmt(o['baton'][key])} / {stats.fmt(o['direct'][key])}"

    done = f"{s['completed']}/{s['failed']}/{s['truncated']} of {s['requests']}"
    rows = [
        ["requests completed/failed/truncated", done],
        ["byte-identical (of completed)", f"{stats.fmt(s['identical_pct'], 1)} %"],
        ["kills performed", str(s["kills"])],
        ["failover events", str(s["failovers"])],
        ["  by outcome", counts(s["by_outcome"])],
        ["  by seam", counts(s["by_seam"])],
        ["  resumed cut mid-character (text held back)", str(s.get("mid_character", 0))],
        ["  by failure", counts(s["by_failure"])],
        ["gap p50 / p99 (ms)", p50_99(s["gap_ms"])],
        [f"floor p50 / p99 (ms, n={s['floor_samples']})", p50_99(s["floor_ms"])],
        ["gap p50 / floor p50", stats.fmt(s["gap_over_floor"])],
        ["floor, a kill's resumes together p50 / p99 (ms)", p50_99(s["floor_together_ms"])],
        ["gap p50 / floor-together p50", stats.fmt(s["gap_over_floor_together"])],
        ["floor, same resumes direct to the same backend under load p50 / p99 (ms)",
         p50_99(s["floor_loaded_ms"])],
        ["gap p50 / floor-under-load p50", stats.fmt(s["gap_over_floor_loaded"])],
        [f"engine floor: the new backend's own TTFT p50 / p99 (ms, n="
         f"{s['engine_floor_samples']})", p50_99(s["engine_floor_ms"])],
        ["  gap of the same failovers p50 / p99 (ms)", p50_99(s["engine_matched_gap_ms"])],
        ["  gap p50 / engine floor p50", stats.fmt(s["gap_over_engine_floor"])],
        ["  Baton's share (gap - engine TTFT) p50 / p99 (ms)", p50_99(s["baton_added_ms"])],
        ["SIGKILL -> resumed text p50 / p99 (ms)", p50_99(s["kill_to_resume_ms"])],
        ["client wait at the seam p50 / p99 (ms)", p50_99(s["seam_stall_ms"])],
        ["no-kill TTFT p50 baton / direct (ms)", vs("ttft_p50")],
        ["no-kill total p50 baton / direct (ms)", vs("total_p50")],
        ["no-kill errors baton / direct", f"{o['baton']['errors']} / {o['direct']['errors']}"],
        ["machine CPU busy direct / baton / chaos", " / ".join(stats.fmt(busy.get(k, stats.NAN))
                                                       for k in ("direct", "baton", "chaos"))],
    ]  # fmt: skip
    table = stats.render_table(("metric", "value"), rows)
    return "\n".join([table, "", *stats.target_lines(targets(s))])


# -- I/O ----------------------------------------------------------------------------------------
async def reference(
    session: aiohttp.ClientSession, url: str, prompt: str, tokens: int
) -> Reference:
    """Streamed, so the reference also says where the engine held text back."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "return_token_ids": True, "stream": True}  # fmt: skip
    prompt_ids: tuple[int, ...] = ()
    ids: list[int] = []
    text: list[str] = []
    held: set[int] = set()
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            for ch in json.loads(line[6:]).get("choices") or ():
                if ch.get("prompt_token_ids"):
                    prompt_ids = tuple(ch["prompt_token_ids"])
                ids += ch.get("token_ids") or []
                text.append(ch.get("text") or "")
                if not ch.get("text"):
                    held.add(len(ids))
    return Reference(prompt, prompt_ids, tuple(ids), "".join(text), frozenset(held))


async def floor_ttft(
    session: aiohttp.ClientSession, url: str, ref: Reference, sent: int, tokens: int
) -> float:
    # Exactly what a resume after `sent` tokens prefills; its first token is the next one.
    body = {"model": MODEL, "prompt": [*ref.prompt_ids, *ref.token_ids[:sent]],
            "max_tokens": max(1, tokens - sent), "temperature": 0, "stream": True}  # fmt: skip
    rec = await stream_one(session, url, body, StreamRecord(0))
    return rec.arrivals[0] * 1e3 if rec.verdict == "completed" and rec.arrivals else stats.NAN


@dataclass(slots=True)
class Plan:
    requests: int
    concurrency: int
    backends: int
    tokens: int
    kill_every: float
    seed: int
    prompts: int = 16
    byte_level: bool = False  # sims with a byte-level vocabulary: multi-byte text, split


@dataclass(slots=True)
class Phases:
    """The run's phases over one client session; `busy` collects each phase's CPU use."""

    fleet: Fleet
    plan: Plan
    session: aiohttp.ClientSession
    prompts: list[str]
    busy: dict[str, float] = field(default_factory=dict)

    async def load(self, name: str, n: int, to: Callable[[int], str]) -> list[StreamRecord]:
        p = self.plan
        # An unrecorded round first, so connection set-up is in no phase's numbers.
        await load(self.session, p.concurrency, p.concurrency, p.tokens, self.prompts, to)
        before = machine_busy()
        out = await load(self.session, n, p.concurrency, p.tokens, self.prompts, to)
        self.busy[name] = busy_fraction(before, machine_busy())
        return out

    async def chaos(self, kills: KillLog) -> list[StreamRecord]:
        stop = asyncio.Event()
        schedule = chaos_schedule(self.plan.seed, self.plan.kill_every, count=10_000)
        task = asyncio.create_task(chaos(self.fleet, schedule, stop, kills))
        try:
            return await self.load("chaos", self.plan.requests, lambda i: self.fleet.shim.ready)
        finally:
            stop.set()  # the chaos ends with the load, and waits for its restarts
            await task

    async def floors(
        self, events: Sequence[Mapping[str, Any]], records: Sequence[StreamRecord],
        refs: Sequence[Reference],
    ) -> list[tuple[Mapping[str, Any], float]]:  # fmt: skip
        """(event, floor ms) for a seeded sample of resumed failovers, one at a time."""
        by_rid = {r.rid: r for r in records}
        resumed = [e for e in events if e["outcome"] == "resumed" and e["request_id"] in by_rid]
        sample = Random(self.plan.seed).sample(resumed, min(FLOOR_SAMPLES, len(resumed)))
        return [
            (e, await floor_ttft(self.session, self.fleet.floor.ready,
                                 refs[by_rid[e["request_id"]].prompt], int(e["tokens_sent"]),
                                 self.plan.tokens))
            for e in sample
        ]  # fmt: skip


async def run(fleet: Fleet, plan: Plan) -> dict[str, Any]:
    prompts = make_prompts(plan.seed, plan.prompts)
    sims, quarter, kills = list(fleet.sims), max(1, plan.requests // 4), KillLog([], [])
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        ph = Phases(fleet, plan, session, prompts)
        s0 = fleet.sims["s0"].ready
        refs = await asyncio.gather(*(reference(session, s0, p, plan.tokens) for p in prompts))
        # Direct goes round robin over the sims, so each carries the batch it has behind Baton.
        direct = await ph.load("direct", quarter, lambda i: fleet.sims[sims[i % len(sims)]].ready)
        baton = await ph.load("baton", quarter, lambda i: fleet.shim.ready)
        records = await ph.chaos(kills)
        # Before the floor phases, which send the same resume prompts again.
        logs = {sid: read_jsonl(fleet.timing_path(sid)) for sid in fleet.sims}
        events = await asyncio.to_thread(failover_events, fleet.control.ready)
        floors = await ph.floors(events, records, refs)
        together = await floors_together(
            session,
            fleet.floor.ready,
            kill_groups(events)[:FLOOR_SAMPLES],
            {r.rid: r for r in records},
            refs,
            plan.tokens,
        )
        loaded = await floors_under_load(ph, kill_groups(events)[:FLOOR_SAMPLES],
                                         {r.rid: r for r in records}, refs)  # fmt: skip
    measured = [v for _, v in floors if not math.isnan(v)]
    engine = engine_ttfts(events, {r.rid: r for r in records}, refs, logs)
    return {
        "summary": summarize(
            records, refs, events, measured, kills.kills, together, engine, loaded
        ),
        "overhead": overhead(direct, baton),
        "cpu_busy": ph.busy,
        "kills": kills.kills,
        "restarts": kills.restarts,
        "skipped_kills": kills.skipped,
        "events": events,
        "records": [asdict(r) for r in records],
        "floor_samples": [{**e, "floor_ms": v} for e, v in floors],
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a SIGKILL
    return out


async def floors_under_load(
    ph: Phases,
    groups: Sequence[Sequence[Mapping[str, Any]]],
    rids: Mapping[str, StreamRecord],
    refs: Sequence[Reference],
) -> list[float]:
    """The physical floor under the run's conditions: each kill's resumes, sent together by a
    plain client straight to the backend that took them (its prefix cache warm with the run's
    prompts, as it was), while the fleet carries the run's load (the same closed loop at the
    same concurrency, through the shim as in the chaos phase, so every process that was busy
    then is busy now). No router in the way of the resumes: what any client would wait."""
    fleet, plan = ph.fleet, ph.plan
    background = asyncio.create_task(
        load(ph.session, 1_000_000, plan.concurrency, plan.tokens, ph.prompts,
             lambda i: fleet.shim.ready)
    )  # fmt: skip
    out: list[float] = []
    try:
        await asyncio.sleep(0.5)  # the load reaches its steady state
        for group in groups:
            part = fleet.sims.get(str(group[0]["to_backend"]))
            if part is None:
                continue
            ttfts = await asyncio.gather(*(
                floor_ttft(ph.session, part.ready, refs[rids[e["request_id"]].prompt],
                           int(e["tokens_sent"]), plan.tokens)
                for e in group if e["request_id"] in rids
            ))  # fmt: skip
            out += [t for t in ttfts if not math.isnan(t)]
    finally:
        background.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await background
    return out


async def floors_together(
    session: aiohttp.ClientSession, url: str, groups: Sequence[Sequence[Mapping[str, Any]]],
    rids: Mapping[str, StreamRecord], refs: Sequence[Reference], tokens: int,
) -> list[float]:  # fmt: skip
    """The floor when a kill sends several streams to one card at once: each group's resume
    prompts replayed together, directly, on an idle sim (no router in the way)."""
    out: list[float] = []
    for group in groups:
        ttfts = await asyncio.gather(*(
            floor_ttft(session, url, refs[rids[e["request_id"]].prompt], int(e["tokens_sent"]),
                       tokens)
            for e in group if e["request_id"] in rids
        ))  # fmt: skip
        out += [t for t in ttfts if not math.isnan(t)]
    return out


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(
        prog="python -m bench.failover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="40 requests")
    p.add_argument("--requests", type=int, help="streams in the chaos phase (default 400)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--backends", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="max_tokens per stream")
    p.add_argument("--kill-every", type=float, default=0.4, help="mean seconds between kills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--byte-level", action="store_true",
                   help="byte-level sims: characters split across tokens, invalid UTF-8")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--workload", choices=WORKLOADS, default="completions",
                   help="agent: tool-calling conversations next to plain chat "
                        "(bench/agent_failover.py; --workload agent --help for its options)")
    a = p.parse_args(argv)
    if a.backends < 2:
        p.error("--backends must be at least 2: a resume needs somewhere to go")
    n = a.requests if a.requests is not None else (40 if a.quick else 400)
    plan = Plan(n, a.concurrency, a.backends, a.tokens, a.kill_every, a.seed,
                byte_level=a.byte_level)  # fmt: skip
    return plan, a.json


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", choices=WORKLOADS, default="completions")
    chosen, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if chosen.workload == "agent":
        return agent_failover.main(rest)
    plan, json_path = parse_args(rest)
    try:
        extra = ("--byte-level",) if plan.byte_level else ()
        with Fleet(json_path.parent, plan.backends, extra) as fleet:
            await_serving(fleet.shim.ready)
            doc = asyncio.run(run(fleet, plan))
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    print(report(doc["summary"], doc["overhead"], doc["cpu_busy"]))
    doc["plan"] = asdict(plan)
    doc["targets"] = [{**asdict(t), "verdict": t.verdict} for t in targets(doc["summary"])]
    stats.write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
