"""`python -m bench.chaos`: a chaos soak, loopback only, bounded in requests and in time.

B sims, one control (with a data dir) and two shims run as real processes. Greedy streams
alternate between the shims at concurrency C:

1. Warm-up: W streams, no chaos. Then the resident memory (RSS) of every process is read.
2. Soak: 10 x W streams while sims are SIGKILLed and restarted on their old ports at random
   (bench/chaos_fleet.py, never leaving no settled sim), and control is SIGKILLed once, a
   tenth of the way in, and restarted on the same address with the same data dir.
   The restarted control's RSS baseline is read after W more streams (its own warm-up).
   RSS is read again at the end.

Every stream is checked against the reference (each prompt's uninterrupted completion from
s0): completed, failed (an HTTP error or an error event: client-visible), or truncated (no
[DONE] and no error: the worst outcome). The p99 failover gap comes from control's audit
log (failover events, as the shims reported them; reports made while control was down
arrive only if the shims buffered them). Prints a table and PASS/FAIL lines (benchmarks never
gate) and writes JSON with every record.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import stats
from bench.chaos_fleet import (
    Fleet,
    KillLog,
    StreamRecord,
    chaos,
    chaos_schedule,
    failover_events,
    fleet_toml,
    stream_one,
)
from bench.failover import Reference, make_prompts, reference
from bench.overhead import await_serving
from bench.parts import MODEL, shim_argv
from bench.sim_zygote import Forked
from clients.procs import Part, StartFailed

DEFAULT_JSON = Path(__file__).parent / "results" / "chaos.json"
SOAK_FACTOR = 10
RESTART_TRIES = 8


# -- pure ---------------------------------------------------------------------------------------
def rss_growth(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, float]:
    """Percent growth per process present in both samples (KiB in, % out)."""
    return {k: 100 * (after[k] - v) / v for k, v in before.items() if k in after and v > 0}


def summarize(
    records: Sequence[StreamRecord],
    refs: Sequence[Reference],
    events: Sequence[Mapping[str, Any]],
    planned: int,
) -> dict[str, Any]:
    verdicts = Counter(r.verdict for r in records)
    completed = [r for r in records if r.verdict == "completed"]
    same = sum(r.text == refs[r.prompt].text for r in completed)
    gaps = [float(e["gap_ms"]) for e in events if e.get("outcome") == "resumed"]
    return {
        "planned": planned,
        "sent": len(records),
        "completed": verdicts["completed"],
        "failed": verdicts["failed"],
        "truncated": verdicts["truncated"],
        "identical_pct": 100 * same / len(completed) if completed else stats.NAN,
        "failovers": len(events),
        "by_outcome": dict(Counter(str(e.get("outcome")) for e in events)),
        "gap_ms": stats.p50_p99(gaps),
        "errors_by_kind": dict(Counter(_error_kind(r) for r in records if r.verdict == "failed")),
    }


def _error_kind(r: StreamRecord) -> str:
    if r.status != 200:
        return f"http {r.status}" if r.status else r.error.split(":", 1)[0]
    try:
        return str(json.loads(r.error)["error"].get("code") or "error event")
    except (ValueError, KeyError, AttributeError, TypeError):
        return r.error.split(":", 1)[0] or "error"


def audit_balance(shims: Sequence[str], logged: int) -> dict[str, int]:
    """Every failover a shim reported (its own counter) must be in control's log unless the
    shim dropped it at its buffer bound (counted) while control was away."""
    reported = dropped = 0
    for base in shims:
        text = http_get(base + "/metrics")
        reported += int(metric_sum(text, "baton_shim_failovers_total"))
        dropped += int(metric_sum(text, "baton_shim_dropped_reports_total", 'kind="failover"'))
        dropped += int(metric_sum(text, "baton_shim_rejected_reports_total"))
    return {"audit_reported": reported, "audit_dropped": dropped,
            "audit_lost": reported - dropped - logged}  # fmt: skip


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def metric_sum(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith(name)
            and line[len(name) : len(name) + 1] in (" ", "{")
            and (labels in line)
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def targets(s: Mapping[str, Any], growth: Mapping[str, float]) -> list[stats.Target]:
    out = [
        stats.Target("truncated streams", s["truncated"], 0),
        stats.Target("client-visible errors", s["failed"], 0),
        stats.Target("byte-identical % of completed", s["identical_pct"], 100, True),
        stats.Target("failover events lost below the shims' buffer bound", s["audit_lost"], 0),
    ]
    for name in sorted(growth):
        if name.startswith(("shim", "control")):
            out.append(stats.Target(f"RSS growth % {name}", abs(growth[name]), 10))
    return out


# -- the fleet ----------------------------------------------------------------------------------
class ChaosFleet(Fleet):
    """bench/chaos_fleet.Fleet (sims that chaos() kills and restarts) with a control that has
    a data dir and can be restarted on its own address, and two shims."""

    def __init__(self, logdir: Path, backends: int) -> None:
        self._init_sims(logdir, backends)
        try:
            self._config = logdir / "chaos.control.toml"
            self._config.write_text(fleet_toml(self.sims))
            self._data = logdir / "chaos.data"
            with contextlib.suppress(FileNotFoundError):  # a fresh audit log per run
                for f in self._data.iterdir():
                    f.unlink()
            self.control = self._start("control", self._control_argv("127.0.0.1:0"))
            self.shims = [self._start(f"shim{i}", shim_argv(self.control.ready)) for i in (0, 1)]
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ChaosFleet:
        return self

    def _control_argv(self, listen: str) -> list[str]:
        return ["control", "--config", str(self._config), "--listen", listen,
                "--metrics-listen", "127.0.0.1:0", "--data-dir", str(self._data)]  # fmt: skip

    def restart_control(self) -> tuple[float, float]:
        """SIGKILL control and start it again on the same address; (down at, up at)."""
        with self._lock:
            old = self.control
            self._others.remove(old)
        down = time.monotonic()
        old.kill()
        if old.proc.stdout:
            old.proc.stdout.close()
        for _ in range(RESTART_TRIES):
            try:
                part = self._start("control", self._control_argv(old.ready))
            except StartFailed:
                time.sleep(0.25)  # the port can be briefly busy
                continue
            self.control = part
            return down, time.monotonic()
        raise StartFailed(f"control did not come back on {old.ready}")

    def processes(self) -> dict[str, int]:
        with self._lock:
            shims = {f"shim{i}": s for i, s in enumerate(self.shims)}
            named: dict[str, Part | Forked] = {"control": self.control, **shims, **self.sims}
        return {name: p.pid for name, p in named.items() if p.alive}


def rss_kib(pids: Mapping[str, int]) -> dict[str, int]:
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out[name] = int(line.split()[1])
    return out


# -- the run ------------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    warmup: int
    concurrency: int
    backends: int
    tokens: int
    kill_every: float
    max_seconds: float
    seed: int
    prompts: int = 16


@dataclass(slots=True)
class Progress:
    done: int = 0
    waiters: list[tuple[int, asyncio.Event]] = field(default_factory=list)

    def tick(self) -> None:
        self.done += 1
        for n, ev in self.waiters:
            if self.done >= n:
                ev.set()

    async def reach(self, n: int) -> None:
        ev = asyncio.Event()
        self.waiters.append((n, ev))
        if self.done >= n:
            ev.set()
        await ev.wait()


async def streams(
    session: aiohttp.ClientSession, fleet: ChaosFleet, plan: Plan, prompts: Sequence[str],
    n: int, deadline: float, progress: Progress,
) -> list[StreamRecord]:  # fmt: skip
    """n streams, closed loop at the plan's concurrency, alternating shims; none is started
    after `deadline` (monotonic)."""
    out: list[StreamRecord] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            if time.monotonic() > deadline:
                return
            p = i % len(prompts)
            body = {"model": MODEL, "prompt": prompts[p], "max_tokens": plan.tokens,
                    "temperature": 0, "stream": True}  # fmt: skip
            url = fleet.shims[i % 2].ready
            out.append(await stream_one(session, url, body, StreamRecord(p)))
            progress.tick()

    async with asyncio.TaskGroup() as tg:
        for _ in range(plan.concurrency):
            tg.create_task(worker())
    return out


async def run(fleet: ChaosFleet, plan: Plan) -> dict[str, Any]:
    prompts = make_prompts(plan.seed, plan.prompts)
    deadline = time.monotonic() + plan.max_seconds
    timeout = aiohttp.ClientTimeout(total=60, sock_connect=5)
    soak_n = SOAK_FACTOR * plan.warmup
    kills = KillLog([], [])
    rss: dict[str, dict[str, int]] = {}
    control_log: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        s0 = fleet.sims["s0"].ready
        refs = await asyncio.gather(*(reference(session, s0, p, plan.tokens) for p in prompts))
        warm = await streams(session, fleet, plan, prompts, plan.warmup, deadline, Progress())
        rss["warm"] = rss_kib(fleet.processes())
        stop, progress = asyncio.Event(), Progress()
        schedule = chaos_schedule(plan.seed, plan.kill_every, count=10_000)
        sims = asyncio.create_task(chaos(fleet, schedule, stop, kills))

        async def control_chaos() -> None:
            await progress.reach(soak_n // 10)
            down, up = await asyncio.to_thread(fleet.restart_control)
            control_log.update(down=down, up=up, at_request=progress.done)
            await progress.reach(progress.done + plan.warmup)
            rss["control_rewarm"] = rss_kib({"control": fleet.control.proc.pid})

        restart = asyncio.create_task(control_chaos())
        try:
            soak = await streams(session, fleet, plan, prompts, soak_n, deadline, progress)
        finally:
            stop.set()
            await sims
            restart.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restart
        rss["end"] = rss_kib(fleet.processes())
    events = await asyncio.to_thread(failover_events, fleet.control.ready)
    audit = await asyncio.to_thread(audit_balance, [s.ready for s in fleet.shims], len(events))
    base = {**rss["warm"], **rss.get("control_rewarm", {})}
    return {
        "warmup": summarize(warm, refs, [], plan.warmup),
        "summary": {**summarize(soak, refs, events, soak_n), **audit},
        "rss_kib": rss,
        "rss_growth_pct": rss_growth(base, rss["end"]),
        "restarted": sorted({sid for _, sid in kills.kills} | {"control"}),
        "control_restart": {k: round(v, 3) for k, v in control_log.items()},
        "kills": len(kills.kills),
        "sim_restarts_failed": sum(not ok for _, _, ok in kills.restarts),
        "records": [asdict(r) for r in soak],
    }


def report(doc: Mapping[str, Any]) -> str:
    s, w = doc["summary"], doc["warmup"]
    rss, growth, restart = doc["rss_kib"], doc["rss_growth_pct"], doc["control_restart"]

    def counts(d: Mapping[str, int]) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"

    rows = [
        ["warm-up streams completed / failed / truncated",
         f"{w['completed']} / {w['failed']} / {w['truncated']} of {w['sent']}"],
        ["soak streams completed / failed / truncated",
         f"{s['completed']} / {s['failed']} / {s['truncated']} of {s['sent']}"
         f" (planned {s['planned']})"],
        ["  client-visible errors by kind", counts(s["errors_by_kind"])],
        ["byte-identical (of completed)", f"{stats.fmt(s['identical_pct'], 1)} %"],
        ["sim kills / failed restarts", f"{doc['kills']} / {doc['sim_restarts_failed']}"],
        ["control restart (at soak stream, s until READY)",
         f"{restart.get('at_request', '-')}, "
         f"{stats.fmt(restart.get('up', stats.NAN) - restart.get('down', stats.NAN))}"],
        ["failover events in control's log", str(s["failovers"])],
        ["  reported by the shims / dropped at their bound / lost",
         f"{s['audit_reported']} / {s['audit_dropped']} / {s['audit_lost']}"],
        ["  by outcome", counts(s["by_outcome"])],
        ["failover gap p50 / p99 (ms)",
         f"{stats.fmt(s['gap_ms']['p50'])} / {stats.fmt(s['gap_ms']['p99'])}"],
    ]  # fmt: skip
    base = {**rss["warm"], **rss.get("control_rewarm", {})}
    for name in sorted(base, key=lambda n: (n[0] != "c", n)):
        mark = " (restarted; baseline after its own warm-up)" if name == "control" else ""
        if name in doc["restarted"] and name != "control":
            mark = " (SIGKILLed and restarted during the soak)"
        end = rss["end"].get(name)
        rows.append([f"RSS {name} warm -> end (MiB){mark}",
                     f"{base[name] / 1024:.1f} -> {end / 1024 if end else float('nan'):.1f} "
                     f"({stats.fmt(growth.get(name, stats.NAN), 1)} %)"])  # fmt: skip
    table = stats.render_table(("metric", "value"), rows)
    return "\n".join([table, "", *stats.target_lines(targets(s, growth))])


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="warm-up 20 (soak 200), 60 s at most")
    p.add_argument("--warmup", type=int, help="warm-up streams (default 100; the soak is 10x)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--backends", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="max_tokens per stream")
    p.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between kills")
    p.add_argument("--max-seconds", type=float, help="no stream starts after this (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = p.parse_args(argv)
    if a.backends < 2:
        p.error("--backends must be at least 2: a resume needs somewhere to go")
    warmup = a.warmup if a.warmup is not None else (20 if a.quick else 100)
    limit = a.max_seconds if a.max_seconds is not None else (60.0 if a.quick else 300.0)
    plan = Plan(warmup, a.concurrency, a.backends, a.tokens, a.kill_every, limit, a.seed)
    return plan, a.json


def main(argv: list[str] | None = None) -> int:
    plan, json_path = parse_args(argv)
    try:
        with ChaosFleet(json_path.parent, plan.backends) as fleet:
            for shim in fleet.shims:
                await_serving(shim.ready)
            doc = asyncio.run(run(fleet, plan))
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    print(report(doc))
    doc["plan"] = asdict(plan)
    doc["targets"] = [{**asdict(t), "verdict": t.verdict} for t in targets(
        doc["summary"], doc["rss_growth_pct"])]  # fmt: skip
    stats.write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
