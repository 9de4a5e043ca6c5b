"""`python -m bench.speculative`: router-level speculative decoding on a sim fleet, measured
against target-only through Baton and against the target directly, in the same run.

Real processes on 127.0.0.1 (free ports): target sims t0..tN (the model, `--decode-ms-per-step`
T), one draft sim per agreement rate P (`--draft-agree-rate P`, decode T/R and prefill
scaled by 1/R: a draft R times cheaper than its target), one control, one shim. Drafts are
registered with role draft; t1.. stay drained except in the gate phases, so every request of
the main phases lands on t0.

Phases, one request at a time (tokens/s *per request*: completion tokens / client wall time):

1. Reference and warm-up: each prompt's greedy completion direct from t0 (the byte-identity
   reference), and a 1-token request per prompt to every other sim (their prefix caches hold
   the prompts, as t0's does).
2. Per agreement rate: a baseline block (per prompt, alternating order: direct to t0, and
   target-only through Baton), then per k: `pairs bind d<P> t0 -k k`, every prompt through
   Baton (spec mode), pair stats read back (`acceptance` = control's EWMA of accepted/drafted,
   `rounds`), `pairs unbind`. A final baseline block closes the run, so drift lands on both.
   *Target-only through Baton* is the same request on the same fleet with the pair unbound:
   the shim then proxies it to t0 like any request (an honest "Baton without spec" baseline;
   a request made ineligible by some extra field would test a different request).
3. Gate, no kill: pair d<P>(gate rate)->t0 bound; t0 and t1 are drained/undrained in turns, so
   the pair is re-paired (`repair`, adopted by the routable target) and the first request on
   the new pairing runs the GatePairing probe round before emitting. Cost = that first
   request's wall time minus the median of the next ones (same prompt, same output), and the
   time from the `repair` event to the verdict event.
4. Gate after a real failover: a spec stream on the pair's target, which is SIGKILLed
   mid-stream while a spare is undrained; the shim fails over, control re-pairs, the probe
   round is judged. Reported: repair->verdict time, verdict, and that the resumed stream is
   still byte-identical to the reference.

Every Baton output (spec, target-only, gate phases) is compared with the direct reference;
the count is printed. Benchmarks never gate: the exit status says only whether it ran.
Prints a table; writes JSON (summary + every request) to bench/results/speculative.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from random import Random
from typing import Any

from bench import stats
from bench.overhead import await_serving
from bench.parts import MODEL, control_argv, control_toml, shim_argv, sim_argv, starter
from clients.client import AdminClient
from clients.procs import Part

DEFAULT_JSON = Path(__file__).parent / "results" / "speculative.json"
WORDS = (
    "amber river quietly stone north lantern maple orbit velvet harbor cinder meadow "
    "falcon copper thistle glacier echo saffron willow beacon ember prism tundra"
).split()
VERDICTS = ("accept", "probation", "reject")
HTTP_TIMEOUT = 60.0


# -- pure helpers -------------------------------------------------------------------------------


def make_prompts(seed: int, count: int, words: int = 48) -> list[str]:
    """`count` distinct prompts of about `words` words (a realistic prefill per request)."""
    rng = Random(seed)
    return [f"{i}: " + " ".join(rng.choices(WORDS, k=words)) for i in range(count)]


def expected_tokens_per_round(p: float, k: int) -> float:
    """Tokens a round emits when each draft token matches the target's argmax independently
    with probability p: the accepted prefix (geometric, capped at k) plus the target's own
    token, i.e. sum_{i=0..k} p^i."""
    if k < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"need k >= 0 and p in [0, 1], got k={k}, p={p}")
    return float(sum(p**i for i in range(k + 1)))


def ideal_speedup(p: float, k: int, draft_ratio: float) -> float:
    """Decode-only model of spec vs target-only tokens/s, network and prefill ignored: a round
    costs k-1 draft steps (the first draft token comes with its prefill, like any first
    token) at 1/draft_ratio of a target step, plus one target scoring step, and emits
    expected_tokens_per_round tokens, where target-only emits one per step."""
    if draft_ratio <= 0:
        raise ValueError("draft_ratio must be > 0")
    round_cost = max(k - 1, 0) / draft_ratio + 1.0
    return expected_tokens_per_round(p, k) / round_cost


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else stats.NAN


def gate_intervals(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """For every `repair` pair event, the first later verdict (accept/probation/reject) of the
    same pair: the gate's decision and the milliseconds it took (probe round + GatePairing
    RPC as seen by control). A repair with no verdict yet gets verdict None, ms NaN."""
    ordered = sorted(events, key=lambda e: float(e["time"]))
    out: list[dict[str, Any]] = []
    for i, e in enumerate(ordered):
        if e.get("action") != "repair":
            continue
        verdict = next(
            (
                v
                for v in ordered[i + 1 :]
                if v.get("pair") == e.get("pair") and v.get("action") in VERDICTS
            ),
            None,
        )
        out.append({
            "pair": e.get("pair"),
            "previous": e.get("previous"),
            "target": e.get("target"),
            "verdict": verdict.get("action") if verdict else None,
            "observed": verdict.get("observed") if verdict else None,
            "baseline": verdict.get("baseline") if verdict else None,
            "ms": (float(verdict["time"]) - float(e["time"])) * 1000 if verdict else stats.NAN,
        })  # fmt: skip
    return out


def extra_ms(first_s: float, next_s: Sequence[float]) -> float:
    """The first request's wall time over the median of the identical ones after it, in ms."""
    return (first_s - stats.median(next_s)) * 1000 if next_s else stats.NAN


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it."""

    mode: str  # direct | target | spec | gate-first | gate-next | failover
    prompt: int
    wall_s: float
    tokens: int
    text: str
    identical: bool
    rate: float | None = None
    k: int | None = None
    block: int | None = None  # baseline block (direct/target): block g precedes rate group g

    @property
    def tps(self) -> float:
        return tokens_per_s(self.tokens, self.wall_s)


def median_tps(samples: Sequence[Sample]) -> float:
    return stats.median(s.tps for s in samples)


@dataclass(frozen=True, slots=True)
class CellResult:
    rate: float
    k: int
    spec_tps: float
    acceptance: float  # control's EWMA over this cell's requests
    rounds: int
    tokens: int
    requests: int
    wall_s: float  # summed over the cell's requests

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else stats.NAN

    @property
    def ms_per_round(self) -> float:
        """Client wall time per round (prompt tokenize and detokenize calls included): what
        one extra round, like the gate's probe, should cost."""
        return self.wall_s * 1000 / self.rounds if self.rounds else stats.NAN


def identical_counts(samples: Sequence[Sample]) -> tuple[int, int]:
    return sum(s.identical for s in samples), len(samples)


TABLE_HEADERS = (
    "P", "k", "spec tok/s", "tgt tok/s", "direct tok/s", "spec/tgt", "spec/direct",
    "ideal", "accept", "tok/round", "theory", "ms/round", "identical",
)  # fmt: skip


def adjacent_baselines(
    samples: Sequence[Sample], rates: Sequence[float]
) -> dict[float, tuple[float, float]]:
    """Per rate group g: the (target-only, direct) median tok/s of the baseline blocks just
    before and after it (blocks g and g+1), so slow drift in the machine's load hits a cell
    and the baseline it is divided by alike."""
    out = {}
    for g, rate in enumerate(rates):
        near = [s for s in samples if s.block in (g, g + 1)]
        out[rate] = (
            median_tps([s for s in near if s.mode == "target"]),
            median_tps([s for s in near if s.mode == "direct"]),
        )
    return out


def table_rows(
    cells: Sequence[CellResult],
    baselines: Mapping[float, tuple[float, float]],
    draft_ratio: float,
    identical: Mapping[tuple[float, int], tuple[int, int]],
) -> list[list[str]]:
    rows = []
    for c in cells:
        same, total = identical.get((c.rate, c.k), (0, 0))
        target_tps, direct_tps = baselines.get(c.rate, (stats.NAN, stats.NAN))
        rows.append([
            f"{c.rate:g}", str(c.k), stats.fmt(c.spec_tps, 1), stats.fmt(target_tps, 1),
            stats.fmt(direct_tps, 1),
            stats.fmt(c.spec_tps / target_tps if target_tps > 0 else stats.NAN),
            stats.fmt(c.spec_tps / direct_tps if direct_tps > 0 else stats.NAN),
            stats.fmt(ideal_speedup(c.rate, c.k, draft_ratio)), stats.fmt(c.acceptance),
            stats.fmt(c.tokens_per_round), stats.fmt(expected_tokens_per_round(c.rate, c.k)),
            stats.fmt(c.ms_per_round, 1), f"{same}/{total}",
        ])  # fmt: skip
    return rows


# -- plan ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    rates: tuple[float, ...]
    ks: tuple[int, ...]
    prompts: int
    max_tokens: int
    target_step_ms: float
    prefill_us: float
    draft_ratio: float
    gate_rate: float
    gate_k: int
    flips: int
    next_requests: int
    kills: int
    seed: int

    @property
    def targets(self) -> int:
        return max(2, self.kills + 1)

    def target_args(self) -> tuple[str, ...]:
        return ("--decode-ms-per-step", f"{self.target_step_ms:g}",
                "--prefill-us-per-token", f"{self.prefill_us:g}")  # fmt: skip

    def draft_args(self, rate: float) -> tuple[str, ...]:
        return ("--decode-ms-per-step", f"{self.target_step_ms / self.draft_ratio:g}",
                "--prefill-us-per-token", f"{self.prefill_us / self.draft_ratio:g}",
                "--draft-agree-rate", f"{rate:g}")  # fmt: skip


def draft_id(rate: float) -> str:
    return f"d{round(rate * 100):02d}"


# -- fleet --------------------------------------------------------------------------------------


@dataclass
class Fleet:
    targets: dict[str, Part]
    drafts: dict[str, Part]
    control: Part
    shim: Part
    admin: AdminClient
    logdir: Path
    stack: contextlib.ExitStack = field(repr=False)

    @property
    def shim_url(self) -> str:
        return self.shim.ready


@contextlib.contextmanager
def running_fleet(plan: Plan, logdir: Path) -> Iterator[Fleet]:
    logdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:

        start = starter(stack, logdir, "speculative")

        targets = {
            f"t{i}": start(f"t{i}", sim_argv("127.0.0.1:0", *plan.target_args()))
            for i in range(plan.targets)
        }
        rates = sorted({*plan.rates, plan.gate_rate})
        drafts = {
            draft_id(r): start(draft_id(r), sim_argv("127.0.0.1:0", *plan.draft_args(r)))
            for r in rates
        }
        config = logdir / "speculative.control.toml"
        config.write_text(
            control_toml({k: p.ready for k, p in targets.items()}, probe_interval=0.2)
        )
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        admin = stack.enter_context(AdminClient(control.ready, timeout=10.0))
        for bid in targets:
            if bid != "t0":
                admin.drain_backend(bid)
        for bid, part in drafts.items():
            admin.add_backend(bid, part.ready, MODEL, role="draft")
        await_serving(shim.ready)
        wait_for(lambda: all(b.state == "healthy" for b in admin.list_backends()
                             if b.id in drafts), "drafts healthy")  # fmt: skip
        yield Fleet(targets, drafts, control, shim, admin, logdir, stack)


def wait_for(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- client -------------------------------------------------------------------------------------


def _body(prompt: str, max_tokens: int, stream: bool = False) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": stream}).encode()  # fmt: skip


def complete(base: str, prompt: str, max_tokens: int) -> tuple[float, str, int]:
    """One non-streaming greedy completion: (wall seconds, text, completion tokens)."""
    req = urllib.request.Request(
        base + "/v1/completions", data=_body(prompt, max_tokens),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as resp:
        raw = resp.read()
    wall = time.perf_counter() - t0
    doc = json.loads(raw)
    return wall, str(doc["choices"][0]["text"]), int(doc["usage"]["completion_tokens"])


def stream(
    base: str, prompt: str, max_tokens: int, on_text: Callable[[str], None]
) -> tuple[float, str, str]:
    """One streaming completion: (wall seconds, text, error ('' if none)); `on_text` sees the
    text so far after every chunk."""
    req = urllib.request.Request(
        base + "/v1/completions", data=_body(prompt, max_tokens, stream=True),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    text, error = "", ""
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as resp:
        for line in resp:
            data = line.strip().removeprefix(b"data: ")
            if not data.startswith(b"{"):
                continue
            obj = json.loads(data)
            if "error" in obj:
                error = json.dumps(obj["error"])
            for ch in obj.get("choices") or ():
                text += ch.get("text") or ""
            on_text(text)
    return time.perf_counter() - t0, text, error


# -- phases -------------------------------------------------------------------------------------


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def references(f: Fleet, plan: Plan, prompts: Sequence[str]) -> list[tuple[str, int]]:
    """Direct greedy output of t0 per prompt; warms every other sim's prefix cache too."""
    refs = []
    for prompt in prompts:
        _, text, tokens = complete(f.targets["t0"].ready, prompt, plan.max_tokens)
        refs.append((text, tokens))
        for name, part in [*f.targets.items(), *f.drafts.items()]:
            if name != "t0":
                complete(part.ready, prompt, 1)
    return refs


def baseline_block(
    f: Fleet, plan: Plan, prompts: Sequence[str], refs: Sequence[tuple[str, int]], block: int
) -> list[Sample]:
    """Direct and target-only through Baton (no pair bound), alternating which goes first."""
    assert not f.admin.pairs(), "target-only needs no pair bound"
    out = []
    for i, prompt in enumerate(prompts):
        order = ("direct", "target") if (i + block) % 2 == 0 else ("target", "direct")
        for mode in order:
            base = f.targets["t0"].ready if mode == "direct" else f.shim_url
            wall, text, tokens = complete(base, prompt, plan.max_tokens)
            out.append(Sample(mode, i, wall, tokens, text, text == refs[i][0], block=block))
    return out


def settled_pair(admin: AdminClient, pair_id: str, tries: int = 40) -> dict[str, Any]:
    """The pair as control lists it once the shim's outcome reports stop arriving (they are
    sent after the client has its answer)."""
    last: dict[str, Any] | None = None
    for _ in range(tries):
        pair = next((p for p in admin.pairs() if p["id"] == pair_id), None)
        if pair is None:
            raise RuntimeError(f"pair {pair_id} vanished")
        if last is not None and pair["rounds"] == last["rounds"]:
            return pair
        last = pair
        time.sleep(0.1)
    assert last is not None
    return last


def spec_cell(
    f: Fleet, plan: Plan, prompts: Sequence[str], refs: Sequence[tuple[str, int]],
    rate: float, k: int,
) -> tuple[CellResult, list[Sample]]:  # fmt: skip
    did = draft_id(rate)
    bound = f.admin.bind_pair(did, "t0", k)
    if bound["state"] != "active" or bound["k"] != k:
        raise RuntimeError(f"bind {did} t0 -k {k}: {bound}")
    samples = []
    try:
        for i, prompt in enumerate(prompts):
            wall, text, tokens = complete(f.shim_url, prompt, plan.max_tokens)
            samples.append(Sample("spec", i, wall, tokens, text, text == refs[i][0], rate, k))
        pair = settled_pair(f.admin, did)
    finally:
        f.admin.unbind_pair(did)
    cell = CellResult(rate, k, median_tps(samples), float(pair["acceptance"]),
                      int(pair["rounds"]), sum(s.tokens for s in samples),
                      len(samples), sum(s.wall_s for s in samples))  # fmt: skip
    return cell, samples


def pair_events(admin: AdminClient, since: float) -> list[dict[str, Any]]:
    return [e for e in admin.events(kind="pair", since=since) if e["time"] >= since]


def gate_flips(
    f: Fleet, plan: Plan, prompts: Sequence[str], refs: Sequence[tuple[str, int]]
) -> tuple[list[dict[str, Any]], list[Sample]]:
    """Re-pair the draft by draining its target and undraining the other, in turns."""
    did = draft_id(plan.gate_rate)
    f.admin.bind_pair(did, "t0", plan.gate_k)
    samples: list[Sample] = []
    flips: list[dict[str, Any]] = []
    p = 0  # one prompt throughout: first and next requests are the same work but the probe

    def one(mode: str) -> Sample:
        wall, text, tokens = complete(f.shim_url, prompts[p], plan.max_tokens)
        s = Sample(mode, p, wall, tokens, text, text == refs[p][0], plan.gate_rate, plan.gate_k)
        samples.append(s)
        return s

    for _ in range(2):  # the paired baseline on the bound target
        one("gate-warm")
    for i in range(plan.flips):
        src, dst = ("t0", "t1") if i % 2 == 0 else ("t1", "t0")
        f.admin.undrain_backend(dst)
        f.admin.drain_backend(src)
        since = time.time()
        first = one("gate-first")
        nexts = [one("gate-next") for _ in range(plan.next_requests)]
        time.sleep(0.1)
        gates = gate_intervals(pair_events(f.admin, since))
        pair = settled_pair(f.admin, did)
        flips.append({
            "from": src, "to": dst, "pair_target": pair["target"],
            "first_s": first.wall_s, "next_s": [s.wall_s for s in nexts],
            "extra_ms": extra_ms(first.wall_s, [s.wall_s for s in nexts]),
            "gates": gates,
        })  # fmt: skip
        progress(f"  flip {src}->{dst}: first {first.wall_s * 1000:.0f} ms, next "
                 f"{stats.median(s.wall_s for s in nexts) * 1000:.0f} ms, gates "
                 f"{[(g['verdict'], round(g['ms'], 1)) for g in gates]}")  # fmt: skip
    return flips, samples


def gate_failovers(
    f: Fleet, plan: Plan, prompts: Sequence[str], refs: Sequence[tuple[str, int]]
) -> tuple[list[dict[str, Any]], list[Sample]]:
    """SIGKILL the pair's target mid-stream with one spare undrained; the shim fails over."""
    did = draft_id(plan.gate_rate)
    current = str(settled_pair(f.admin, did)["target"])
    spares = [t for t in f.targets if t != current]
    for t in spares:
        f.admin.drain_backend(t)
    kills: list[dict[str, Any]] = []
    samples: list[Sample] = []
    for j in range(min(plan.kills, len(spares))):
        spare = spares[j]
        p = (j + 1) % len(prompts)
        victim = f.targets[current]
        killed: list[float] = []

        def on_text(text: str, spare: str = spare, victim: Part = victim,
                    killed: list[float] = killed) -> None:  # fmt: skip
            if not killed and len(text) > 10:
                f.admin.undrain_backend(spare)
                victim.kill()
                killed.append(time.time())

        since = time.time()
        wall, text, error = stream(f.shim_url, prompts[p], plan.max_tokens, on_text)
        time.sleep(0.2)
        gates = [g for g in gate_intervals(pair_events(f.admin, since)) if g["target"] == spare]
        samples.append(Sample("failover", p, wall, 0, text, text == refs[p][0] and not error,
                              plan.gate_rate, plan.gate_k))  # fmt: skip
        kills.append({
            "victim": current, "spare": spare, "killed": bool(killed), "error": error,
            "identical": samples[-1].identical, "wall_s": wall, "gates": gates,
        })  # fmt: skip
        progress(f"  kill {current} -> {spare}: identical {samples[-1].identical}, gates "
                 f"{[(g['verdict'], round(g['ms'], 1)) for g in gates]}")  # fmt: skip
        f.admin.remove_backend(current)
        current = spare
    return kills, samples


# -- report -------------------------------------------------------------------------------------


def summarize(
    plan: Plan,
    cells: Sequence[CellResult],
    samples: Sequence[Sample],
    flips: Sequence[Mapping[str, Any]],
    kills: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    target = [s for s in samples if s.mode == "target"]
    direct = [s for s in samples if s.mode == "direct"]
    spec_like = [s for s in samples if s.mode not in ("direct", "target")]
    target_tps, direct_tps = median_tps(target), median_tps(direct)
    near = adjacent_baselines(samples, plan.rates)
    flip_gates = [g for fl in flips for g in fl["gates"]]
    kill_gates = [g for k in kills for g in k["gates"]]
    return {
        "target_tps": target_tps,
        "direct_tps": direct_tps,
        "target_over_direct": target_tps / direct_tps if direct_tps > 0 else stats.NAN,
        "cells": [
            {
                **asdict(c),
                "tokens_per_round": c.tokens_per_round,
                "ms_per_round": c.ms_per_round,
                "theory_tokens_per_round": expected_tokens_per_round(c.rate, c.k),
                "ideal_speedup": ideal_speedup(c.rate, c.k, plan.draft_ratio),
                "target_tps": near[c.rate][0],
                "direct_tps": near[c.rate][1],
                "spec_over_target": c.spec_tps / near[c.rate][0],
                "spec_over_direct": c.spec_tps / near[c.rate][1],
            }
            for c in cells
        ],  # fmt: skip
        "adjacent_baselines": [[r, t, d] for r, (t, d) in near.items()],
        "identical": {"spec": identical_counts(spec_like), "target": identical_counts(target)},
        "gate_flip_extra_ms": stats.median(float(fl["extra_ms"]) for fl in flips),
        "gate_flip_event_ms": stats.median(float(g["ms"]) for g in flip_gates),
        "gate_failover_event_ms": stats.median(float(g["ms"]) for g in kill_gates),
        "gate_cell_ms_per_round": next(
            (c.ms_per_round for c in cells if (c.rate, c.k) == (plan.gate_rate, plan.gate_k)),
            stats.NAN,
        ),
        "gate_verdicts": sorted({str(g["verdict"]) for g in [*flip_gates, *kill_gates]}),
        "flips": list(flips),
        "kills": list(kills),
    }


def report(plan: Plan, summary: Mapping[str, Any], cells: Sequence[CellResult],
           samples: Sequence[Sample]) -> str:  # fmt: skip
    per_cell = {
        (c.rate, c.k): identical_counts(
            [s for s in samples if s.mode == "spec" and (s.rate, s.k) == (c.rate, c.k)]
        )
        for c in cells
    }
    baselines = {float(r): (float(t), float(d)) for r, t, d in summary["adjacent_baselines"]}
    rows = table_rows(cells, baselines, plan.draft_ratio, per_cell)
    same, total = summary["identical"]["spec"]
    tsame, ttotal = summary["identical"]["target"]
    fmt = stats.fmt
    lines = [
        stats.render_table(TABLE_HEADERS, rows),
        "",
        f"target step {plan.target_step_ms:g} ms, draft {plan.draft_ratio:g}x cheaper "
        f"(decode and prefill), {plan.max_tokens} tokens per request, one request at a time.",
        "tok/s = median over requests of completion tokens / client wall time; tgt = the same",
        "request through Baton with no pair bound; direct = straight to the target sim (both:",
        "the baseline blocks just before and after the row's P group);",
        "ideal = decode-only model of spec/tgt; accept = control's EWMA of accepted/drafted;",
        "tok/round = tokens emitted / rounds counted by control; theory = sum_{i<=k} P^i;",
        "ms/round = client wall time / rounds (what the gate's one probe round should cost).",
        "",
        f"target-only through Baton / direct: {fmt(summary['target_over_direct'], 3)}",
        f"byte-identical to direct target greedy: spec {same}/{total} "
        f"({fmt(100 * same / total if total else stats.NAN, 1)}%), target-only {tsame}/{ttotal}",
        f"gate (probe round + GatePairing), re-pair by drain/undrain, k={plan.gate_k} "
        f"P={plan.gate_rate:g}: first request +{fmt(summary['gate_flip_extra_ms'], 1)} ms over "
        f"the next (median of {len(summary['flips'])}); repair->verdict event "
        f"{fmt(summary['gate_flip_event_ms'], 1)} ms",
        f"one spec round of that cell: {fmt(summary['gate_cell_ms_per_round'], 1)} ms "
        "(the probe's expected price)",
        f"gate after a SIGKILL failover: repair->verdict event "
        f"{fmt(summary['gate_failover_event_ms'], 1)} ms over {len(summary['kills'])} kills, "
        f"streams identical {sum(bool(k['identical']) for k in summary['kills'])}/"
        f"{len(summary['kills'])}; verdicts seen: {', '.join(summary['gate_verdicts']) or '-'}",
    ]
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--quick",
        action="store_true",
        help="P=0.7, k=4, 3 prompts, 32 tokens, 2 flips, 1 kill (~20 s)",
    )
    p.add_argument("--rates", help="draft agreement rates (default 0.4,0.7,0.9)")
    p.add_argument("--ks", help="draft tokens per round (default 2,4,8)")
    p.add_argument("--prompts", type=int, help="prompts per cell (default 5)")
    p.add_argument("--max-tokens", type=int, help="completion tokens per request (default 48)")
    p.add_argument("--target-step-ms", type=float, default=20.0)
    p.add_argument("--prefill-us", type=float, default=20.0, help="target prefill per token")
    p.add_argument(
        "--draft-ratio",
        type=float,
        default=8.0,
        help="how many times cheaper the draft's steps and prefill are",
    )
    p.add_argument("--gate-rate", type=float, default=0.7)
    p.add_argument("--gate-k", type=int, default=4)
    p.add_argument("--flips", type=int, help="re-pairings by drain/undrain (default 4)")
    p.add_argument("--kills", type=int, help="re-pairings by SIGKILL failover (default 2)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    a = p.parse_args(argv)
    q = a.quick

    def floats(s: str | None, default: str) -> tuple[float, ...]:
        return tuple(float(x) for x in (s or default).split(",") if x.strip())

    plan = Plan(
        rates=floats(a.rates, "0.7" if q else "0.4,0.7,0.9"),
        ks=tuple(int(x) for x in floats(a.ks, "4" if q else "2,4,8")),
        prompts=a.prompts or (3 if q else 5),
        max_tokens=a.max_tokens or (32 if q else 48),
        target_step_ms=a.target_step_ms,
        prefill_us=a.prefill_us,
        draft_ratio=a.draft_ratio,
        gate_rate=a.gate_rate,
        gate_k=a.gate_k,
        flips=a.flips if a.flips is not None else (2 if q else 4),
        next_requests=3,
        kills=a.kills if a.kills is not None else (1 if q else 2),
        seed=a.seed,
    )
    if not all(0 <= r <= 1 for r in plan.rates) or min(plan.ks, default=0) < 1:
        p.error("rates must be in [0, 1] and every k >= 1")
    if plan.draft_ratio <= 0 or plan.target_step_ms <= 0 or plan.prompts < 1:
        p.error("--draft-ratio, --target-step-ms and --prompts must be positive")
    return plan, a.json


def run(plan: Plan, json_path: Path) -> int:
    started = time.monotonic()
    prompts = make_prompts(plan.seed, plan.prompts)
    cells: list[CellResult] = []
    samples: list[Sample] = []
    with running_fleet(plan, json_path.parent) as f:
        progress(f"fleet up in {time.monotonic() - started:.1f} s")
        refs = references(f, plan, prompts)
        for g, rate in enumerate(plan.rates):
            samples += baseline_block(f, plan, prompts, refs, g)
            for k in plan.ks:
                cell, got = spec_cell(f, plan, prompts, refs, rate, k)
                cells.append(cell)
                samples += got
                progress(
                    f"  P={rate:g} k={k}: {cell.spec_tps:.1f} tok/s, acceptance "
                    f"{cell.acceptance:.2f}, {cell.tokens_per_round:.2f} tok/round"
                )
        samples += baseline_block(f, plan, prompts, refs, len(plan.rates))
        progress(
            f"  target-only {median_tps([s for s in samples if s.mode == 'target']):.1f}"
            f" tok/s, direct {median_tps([s for s in samples if s.mode == 'direct']):.1f}"
        )
        flips, got = gate_flips(f, plan, prompts, refs)
        samples += got
        kills, got = gate_failovers(f, plan, prompts, refs)
        samples += got
    summary = summarize(plan, cells, samples, flips, kills)
    print(report(plan, summary, cells, samples))
    doc = {
        "plan": asdict(plan),
        "elapsed_s": time.monotonic() - started,
        "summary": summary,
        "requests": [{**asdict(s), "tps": s.tps} for s in samples],
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(stats.finite(doc), allow_nan=False, indent=1))
    print(f"\nwrote {json_path} ({time.monotonic() - started:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--real" in args:  # real vLLM engines: bench/speculative_real.py
        from bench import speculative_real

        return speculative_real.main([a for a in args if a != "--real"])
    plan, json_path = parse_args(argv)
    try:
        return run(plan, json_path)
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
