"""`python -m bench.memory`: what an in-flight stream costs a router process in memory (RSS),
for Baton's shim and, side by side in the same run, the bare aiohttp + uvloop proxy
(bench/floor_proxy.py, the floor of our stack).

Cases (sims with `--instant`, so the engine is never what a stream waits on; chat unless said):

- **read T**: N streams whose client reads everything, held at T generated tokens each: T of
  1,000, 20,000 and 100,000 on the sim's default output, 20,000 on `--byte-level` sims
  (multi-byte characters cut across tokens) and 20,000 on /v1/completions.
- **stalled**: N streams (max_tokens 100,000) whose client reads the response head and 100
  bytes of the body, then stops reading and keeps its socket open.
- **resumed**: N streams that fail over mid-stream and are held at T tokens after the resume
  (Baton only: the floor cannot resume).

Method. Every (case, router, rep) runs in fresh processes (sims, then control + shim or the
floor proxy), so nothing one case left in the allocator is another's baseline. Baseline: after
two rounds of a few short streams through the router (lazy imports, pools, first-request
caches), the measured process's VmRSS once flat; VmHWM is then reset (`5` into
/proc/PID/clear_refs) and VmRSS sampled every 20 ms, so the peak is the case's own.

All N streams are in flight at once, each holding exactly T tokens, because the engine parks
them: the sims run with `--fault stall-after=T` (max_tokens T+1), so every stream stops after
its T-th token with its connection open, its client having read all T (counted as SSE events,
one per token, plus a chat stream's role). Once every stream holds T tokens and the router's
RSS has been flat for `--flat-s`, its RSS (held) and peak since the baseline are read. No
client pauses, so nothing read ahead for a slow client is counted here (that is the stalled
case). The shim runs with `--inter-token-timeout 3600` in the parked cases, so a parked engine
is not taken for a dead one and failed over. Streams that simply run to their end are not
concurrent at full length (an --instant stream ends in a second or so): their peak is lower
and varies with scheduling.

Reported: per stream (peak - baseline) / N; per token (peak - baseline) / tokens the clients
hold; the held (plateau) values, control's RSS change and the shim's own in-flight gauge and
attempt/failover counters at the reading are in the JSON. The slope line fits per-stream peak
bytes against T over the read cases of chat's default output: what a stream holds per token
beyond its fixed cost. With --instant sims the shim reads whatever piled up since its last read
(up to its read buffer), and a stream holds that batch while it is parsed and relayed; that is
a per-stream cost under load, so it lands in the fixed part. `--pace-ms X` paces the sims
(X ms per decode step) instead, for a run without bursts; it is slow (T x X ms at least).

Stalled: the RSS once it moved by at most `--flat-kb` over `--flat-s` (at most `--max-wait`
seconds after the last stream got its head), minus the baseline, per stream.

Resumed: two sims, both `--fault stall-after=T/2` (max_tokens 3T/2). The second is drained
through control's admin API, the N streams all start on the first and park at T/2; the second
is undrained, the first SIGKILLed; Baton resumes each stream on the second, which parks it
again after T/2 more tokens, so each stream holds T tokens after one failover. Tokens held are
the clients' counts. Warm-up does not fail over, so one-time costs of the first failover (code
imported on first use) are in this case's number, spread over its N streams.

Medians over `--reps` (and their range); ratios are Baton's median over the floor's. Writes
every run's raw numbers and the summary as JSON (`--json`). Loops and waits are bounded
(`--max-wait`); every child process is stopped on any exit, Ctrl-C included. Benchmarks never
gate: the exit status says only whether the benchmark itself ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import memory_kit, parts, stats
from bench.memory_kit import BATON, FLOOR, Sampler
from clients.client import AdminClient
from clients.procs import Part

DEFAULT_JSON = Path(__file__).parent / "results" / "memory.json"
PARKED = 3600.0  # seconds a parked engine waits, and the shim's inter-token timeout then
NAN = float("nan")


@dataclass(frozen=True, slots=True)
class Case:
    kind: str  # "read", "stalled" or "resumed"
    streams: int
    tokens: int  # held per stream when read (read, resumed); max_tokens (stalled)
    api: str = "chat"  # or "completions"
    byte_level: bool = False

    @property
    def name(self) -> str:
        size = f"{self.tokens // 1000}k" if self.tokens % 1000 == 0 else str(self.tokens)
        text = {"read": f"read {size}", "stalled": f"stalled, max {size}",
                "resumed": f"resumed, {size}"}[self.kind]  # fmt: skip
        return f"{text} {self.api}" + (" byte-level" if self.byte_level else "")

    @property
    def lead(self) -> int:
        """Events a stream sends before its first token: a chat stream's role."""
        return 1 if self.api == "chat" else 0


@dataclass(frozen=True, slots=True)
class Plan:
    cases: tuple[Case, ...]
    reps: int
    head_bytes: int
    flat_s: float
    flat_kb: int
    max_wait: float
    warmup: int
    pace_ms: float = 0.0  # the sims' time per decode step; 0: --instant


@dataclass(slots=True)
class Router:
    url: str
    pids: dict[str, int]  # the measured process first ("shim" or "floor"), then control
    sims: dict[str, Part]
    control: str = ""  # control's HOST:PORT (Baton only)
    base: dict[str, int] = field(default_factory=dict)  # VmRSS at the baseline, KiB
    hwm_reset: dict[str, bool] = field(default_factory=dict)

    @property
    def measured(self) -> int:
        return next(iter(self.pids.values()))


def sim_fault(case: Case) -> list[str]:
    if case.kind == "stalled":
        return []
    park = case.tokens if case.kind == "read" else case.tokens // 2
    return ["--fault", f"stall-after={park},stall-seconds={PARKED:g}"]


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Ctrl-C waits until the block is over: a part being started is then registered to be
    stopped, not left running because the interrupt came between its start and its stop's
    registration."""
    got: list[int] = []
    old = signal.getsignal(signal.SIGINT)
    if old is signal.SIG_IGN:  # started in the background: nothing to defer
        yield
        return
    signal.signal(signal.SIGINT, lambda sig, frame: got.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if got:
            raise KeyboardInterrupt


def starter(stack: contextlib.ExitStack, logdir: Path) -> Callable[[str, list[str]], Part]:
    """start(name, argv): a part whose stderr goes to logdir/memory.NAME.log, stopped when
    `stack` closes (and sent SIGTERM if this process dies however it dies)."""

    def start(name: str, argv: list[str]) -> Part:
        with sigint_deferred():
            log = stack.enter_context((logdir / f"memory.{name}.log").open("wb"))
            part = Part(name, argv, stderr=log.fileno(), die_with_parent=True)
            stack.callback(part.stop, 3.0)
        return part

    return start


@contextlib.contextmanager
def router(case: Case, target: str, plan: Plan, logdir: Path) -> Iterator[Router]:
    """Fresh sims and a fresh router in front of them; all stopped on any exit, Ctrl-C too."""
    with contextlib.ExitStack() as stack:
        start = starter(stack, logdir)
        pace = ["--prefill-us-per-token", "0", "--decode-ms-per-step", f"{plan.pace_ms:g}",
                "--batch-slowdown", "0"] if plan.pace_ms > 0 else ["--instant"]  # fmt: skip
        extra = [*pace, "--max-model-len", str(2 * case.tokens + 4096), *sim_fault(case),
                 "--max-num-seqs", str(max(256, 2 * case.streams + 16))]  # fmt: skip
        if case.byte_level:
            extra.append("--byte-level")
        sids = ["s0", "s1"] if case.kind == "resumed" else ["s0"]
        sims = {sid: start(sid, parts.sim_argv("127.0.0.1:0", *extra)) for sid in sids}
        if target == FLOOR:
            ups = [a for s in sims.values() for a in ("--upstream", s.ready)]
            floor = start("floor", ["bench.floor_proxy", *ups])
            yield Router(floor.ready, {"floor": floor.pid}, sims)
            return
        config = logdir / f"memory.control.{os.getpid()}.toml"
        stack.callback(config.unlink, missing_ok=True)
        config.write_text(parts.control_toml({sid: s.ready for sid, s in sims.items()}))
        control = start("control", parts.control_argv(str(config)))
        argv = parts.shim_argv(control.ready)
        if case.kind != "stalled":
            argv += ["--inter-token-timeout", f"{PARKED:g}"]
        shim = start("shim", argv)
        deadline = time.monotonic() + 20.0
        while not parts.serves_completion(shim.ready):  # control may still be probing the sims
            if time.monotonic() > deadline:
                raise RuntimeError("the shim did not serve a completion within 20 s")
            time.sleep(0.2)
        yield Router(shim.ready, {"shim": shim.pid, "control": control.pid}, sims, control.ready)


async def baseline(r: Router, case: Case, plan: Plan) -> list[str]:
    """Warm-up, then the baseline RSS of each process and its VmHWM reset; warm-up errors."""
    errors = await memory_kit.warm_up(r.url, 2, plan.warmup, case.api)
    await memory_kit.settled_rss_kb(r.measured, 1.0, 10.0, plan.flat_kb)
    r.base = {name: memory_kit.rss_kb(pid) for name, pid in r.pids.items()}
    r.hwm_reset = {name: memory_kit.reset_hwm(pid) for name, pid in r.pids.items()}
    return errors


async def settled(r: Router, plan: Plan, sampler: Sampler, ok: bool, **more: Any) -> dict[str, Any]:
    """Once the measured process's RSS is flat: the reading of every process, and the shim's
    own gauges (the floor has none)."""
    flat_for = memory_kit.settled_rss_kb
    _, waited, flat = await flat_for(r.measured, plan.flat_s, plan.max_wait, plan.flat_kb)
    none: dict[str, Any] = {"in_flight": NAN, "samples": []}
    shim = await memory_kit.shim_metrics(r.url) if "shim" in r.pids else none
    return {"parked": ok, "flat": flat, "settle_s": waited, **shim,
            "procs": memory_kit.reading(r.pids, r.base, r.hwm_reset, sampler), **more}  # fmt: skip


async def measure_read(r: Router, case: Case, plan: Plan, sampler: Sampler) -> dict[str, Any]:
    """Every stream parked by its engine at T tokens, all of them read by the client."""
    readers = memory_kit.Readers(r.url, case.streams, case.tokens + 1, case.api)
    try:
        want = case.tokens + case.lead

        def parked() -> bool:
            return min(readers.events) >= want or bool(readers.errors)

        ok = await memory_kit.until(parked, plan.max_wait)
        return await settled(r, plan, sampler, ok and not readers.errors,
                             events=list(readers.events), errors=readers.errors[:5])  # fmt: skip
    finally:
        await readers.close()


async def measure_stalled(r: Router, case: Case, plan: Plan, sampler: Sampler) -> dict[str, Any]:
    stalled = memory_kit.Stalled(r.url, case.streams, case.tokens, plan.head_bytes, case.api)
    try:
        ok = await stalled.ready(plan.max_wait) and stalled.started == case.streams
        return await settled(r, plan, sampler, ok, events=[], started=stalled.started,
                             errors=stalled.errors[:5])  # fmt: skip
    finally:
        await stalled.close()


async def measure_resumed(r: Router, case: Case, plan: Plan, sampler: Sampler) -> dict[str, Any]:
    """Streams parked on s0 (s1 drained), s1 undrained, s0 SIGKILLed: each resumes on s1 and
    parks there again, T tokens in all."""
    admin = AdminClient(r.control)
    half = case.tokens // 2
    await asyncio.to_thread(admin.drain_backend, "s1")
    readers = memory_kit.Readers(r.url, case.streams, case.tokens + half, case.api)
    try:
        first = await memory_kit.until(
            lambda: min(readers.events) >= half + case.lead or bool(readers.errors), plan.max_wait
        )
        before = memory_kit.reading(r.pids, r.base, r.hwm_reset, sampler)
        row = await asyncio.to_thread(admin.undrain_backend, "s1")
        healthy = row.state == "healthy" or await memory_kit.until(
            lambda: any(b.id == "s1" and b.state == "healthy" for b in admin.list_backends()),
            30.0, period=0.2,
        )  # fmt: skip
        r.sims["s0"].kill()
        # The seam check may take back a few tokens: "all of them" is a few short of T.
        want = case.tokens + case.lead - 16
        resumed = await memory_kit.until(lambda: min(readers.events) >= want, plan.max_wait)
        ok = first and healthy and resumed and not readers.errors
        return await settled(r, plan, sampler, ok, before_failover=before,
                             events=list(readers.events), errors=readers.errors[:5])  # fmt: skip
    finally:
        await readers.close()
        admin.close()


MEASURE = {"read": measure_read, "stalled": measure_stalled, "resumed": measure_resumed}


async def measure(r: Router, case: Case, plan: Plan) -> dict[str, Any]:
    warm_errors = await baseline(r, case, plan)
    with Sampler(r.pids).running() as sampler:
        raw = await MEASURE[case.kind](r, case, plan, sampler)
    raw.update(warmup_errors=warm_errors[:5], hwm_reset=r.hwm_reset)
    return raw


def one_run(case: Case, target: str, plan: Plan, logdir: Path, rep: int) -> dict[str, Any]:
    with router(case, target, plan, logdir) as r:
        raw = asyncio.run(measure(r, case, plan))
        part = next(iter(r.pids))
    p = raw["procs"][part]
    held = sum(e - case.lead for e in raw["events"])  # tokens the clients hold; 0 if stalled
    added = {"per_stream_kb": p["peak_added_kb"], "held_per_stream_kb": p["held_kb"]}
    control = raw["procs"].get("control", {}).get("peak_added_kb", NAN)
    raw.update(case=case.name, kind=case.kind, api=case.api, target=target, rep=rep,
               streams=case.streams, tokens=case.tokens, byte_level=case.byte_level,
               measured=part, tokens_held=held,
               **{k: v / case.streams for k, v in added.items()},
               bytes_per_token=p["peak_added_kb"] * 1024 / held if held else NAN,
               held_bytes_per_token=p["held_kb"] * 1024 / held if held else NAN,
               control_added_kb=control)  # fmt: skip
    ok = "" if raw["parked"] and raw["flat"] else "  (NOT settled: see JSON)"
    print(f"  rep {rep} {case.name:30} {target:14} +{p['peak_added_kb'] / 1024:7.1f} MiB peak"
          f" {raw['per_stream_kb']:8.1f} KiB/stream {raw['bytes_per_token']:7.1f} B/token"
          f"{ok}", file=sys.stderr, flush=True)  # fmt: skip
    return raw


def run_all(plan: Plan, logdir: Path) -> list[dict[str, Any]]:
    logdir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for rep in range(plan.reps):
        for k, case in enumerate(plan.cases):
            targets = [BATON] if case.kind == "resumed" else stats.rotated([FLOOR, BATON], rep + k)
            for target in targets:
                runs.append(one_run(case, target, plan, logdir, rep))
    return runs


def parse_sizes(text: str, api: str = "chat", byte_level: bool = False) -> list[Case]:
    """`TOKENS:STREAMS,...` -> read cases; an empty string -> none."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        tokens, _, streams = item.partition(":")
        out.append(Case("read", int(streams or 40), int(tokens), api, byte_level))
    return out


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add = p.add_argument
    add("--quick", action="store_true", help="8 streams: chat 1k, 20k, stalled, resumed; 1 rep")
    add("--reps", type=int, help="fresh processes per case and router each (default 3)")
    add("--sizes", default="1000:40,20000:40,100000:10",
        help="read cases, chat, default output: TOKENS:STREAMS,... ('' for none)")  # fmt: skip
    add("--byte-level-sizes", default="20000:40", help="read cases, chat, --byte-level sims")
    add("--completions-sizes", default="20000:40", help="read cases, /v1/completions")
    add("--stalled", type=int, default=40, help="stalled streams, chat (0: no such case)")
    add("--stalled-tokens", type=int, default=100_000, help="their max_tokens")
    add("--head-bytes", type=int, default=100, help="body bytes a stalled client reads")
    add("--resumed", type=int, default=40, help="resumed streams, chat (0: no such case)")
    add("--resumed-tokens", type=int, default=20_000, help="tokens held after the resume")
    add("--flat-s", type=float, default=2.0, help="seconds RSS must stay flat")
    add("--flat-kb", type=int, default=128, help="how flat: KiB moved at most")
    add("--max-wait", type=float, default=300.0, help="seconds to wait on a state, at most")
    add("--warmup", type=int, default=4, help="streams per warm-up round")
    add("--pace-ms", type=float, default=0.0,
        help="the sims' ms per decode step, paced instead of --instant (0: --instant)")  # fmt: skip
    add("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.byte_level_sizes, a.completions_sizes = "1000:8,20000:8", "", ""
        a.stalled = a.resumed = 8
    cases = [*parse_sizes(a.sizes), *parse_sizes(a.byte_level_sizes, "chat", True),
             *parse_sizes(a.completions_sizes, "completions")]  # fmt: skip
    if a.stalled:
        cases.append(Case("stalled", a.stalled, a.stalled_tokens))
    if a.resumed:
        cases.append(Case("resumed", a.resumed, a.resumed_tokens))
    if any(c.streams < 1 or (c.kind != "stalled" and c.tokens < 200) for c in cases):
        p.error("every case needs 1 stream or more, and 200 tokens or more (warm-up: 64)")
    reps = a.reps if a.reps is not None else (1 if a.quick else 3)
    plan = Plan(tuple(cases), reps, a.head_bytes, a.flat_s, a.flat_kb, a.max_wait, a.warmup,
                a.pace_ms)  # fmt: skip
    return plan, a.json


def main(argv: list[str] | None = None) -> int:
    plan, json_path = parse_args(argv)
    load_before = os.getloadavg()[0]
    try:
        runs = run_all(plan, json_path.parent)
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    rows = memory_kit.summarize(plan.cases, runs)
    slope = memory_kit.slopes(rows)
    print(memory_kit.render(rows, slope))
    print(f"\nload average before the run: {load_before:.2f} ({os.cpu_count()} cores)")
    doc = {"plan": asdict(plan), "python": platform.python_version(),
           "kernel": platform.release(), "load_average_before": load_before,
           "summary": rows, "slope_bytes_per_token": slope, "runs": runs}  # fmt: skip
    stats.write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
