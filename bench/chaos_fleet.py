"""The failover benchmark's moving parts: the fleet (B sims, one control, one shim, plus a
floor sim outside the fleet), the chaos that SIGKILLs fleet sims and restarts them on their old
ports, and the streaming client that records exactly what a client saw.

The schedule (when to kill, which draw picks the victim, how long it stays dead) is a pure
function of the seed; only whether a victim is eligible depends on what has happened, and that
rule (`eligible`) is pure too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any, Protocol

import aiohttp
import orjson

from bench.parts import MODEL, control_argv, control_toml, shim_argv, sim_argv
from bench.sim_zygote import Forked, Zygote
from clients.procs import Part, StartFailed

PROBE_INTERVAL = 0.2
# Control re-admits a sim after 2 good probes: one that has been up this long can take a resume.
SETTLE_S = 3 * PROBE_INTERVAL
RESTART_TRIES = 8


@dataclass(frozen=True, slots=True)
class Kill:
    at: float  # seconds after the chaos starts
    draw: float  # in [0, 1): picks the victim among those eligible at that moment
    restart_after: float  # seconds the victim stays dead before its restart begins


def chaos_schedule(seed: int, kill_every: float, count: int) -> list[Kill]:
    """`count` kills, intervals uniform in [0.5, 1.5] x kill_every, restarts after 0.1-0.5 s."""
    rng = Random(seed)
    at, out = 0.0, []
    for _ in range(count):
        at += kill_every * rng.uniform(0.5, 1.5)
        out.append(Kill(round(at, 6), rng.random(), round(rng.uniform(0.1, 0.5), 6)))
    return out


def eligible(up_since: Mapping[str, float | None], now: float, settle: float) -> list[str]:
    """Sims that may be killed now (sorted): alive ones whose death still leaves another sim
    that has been up for `settle` seconds, so a resume always has somewhere to go.
    `up_since` is None for a sim that is dead or restarting."""
    alive = sorted(k for k, t in up_since.items() if t is not None)
    settled = {k for k in alive if (t := up_since[k]) is not None and now - t >= settle}
    return [k for k in alive if settled - {k}]


def pick(draw: float, candidates: Sequence[str]) -> str | None:
    return candidates[min(int(draw * len(candidates)), len(candidates) - 1)] if candidates else None


class Fleet:
    """Real processes; `close()` stops every one of them, including sims restarted later."""

    _sim_extra: tuple[str, ...] = ()  # more arguments for every sim

    def __init__(
        self, logdir: Path, backends: int, sim_extra: Sequence[str] = (),
        backend_keys: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        """`sim_extra`: more arguments for every sim (e.g. --byte-level); `backend_keys`: more
        string keys for every [[backends]] table (e.g. tool_parser)."""
        self._sim_extra = tuple(sim_extra)
        self._init_sims(logdir, backends)
        try:
            # Outside the fleet, prefix cache off: every floor sample pays its whole prefill.
            floor = sim_argv("127.0.0.1:0", "--cache-blocks", "0", *self._sim_extra)
            self.floor = self._start("floor", floor)
            config = logdir / "failover.control.toml"
            config.write_text(fleet_toml(self.sims, backend_keys))
            self.control = self._start("control", control_argv(str(config)))
            self.shim = self._start("shim", shim_argv(self.control.ready))
        except BaseException:
            self.close()
            raise

    def _init_sims(self, logdir: Path, backends: int) -> None:
        """The sims s0..s{backends-1} and the bookkeeping chaos() and restart() rely on (a
        subclass starts its own control and shims after this). Fleet sims are forked from a
        warm parent (bench/sim_zygote.py): their restarts must not take the router's CPU."""
        self._logdir = logdir
        self._lock = threading.Lock()
        self._closed = False
        self._others: list[Part] = []
        self.sims: dict[str, Forked] = {}
        self.ports: dict[str, int] = {}
        self.up_since: dict[str, float | None] = {}
        logdir.mkdir(parents=True, exist_ok=True)
        with (logdir / "failover.sims.log").open("ab") as log:
            self._zygote = Zygote(stderr=log.fileno())
        try:
            for sid in (f"s{i}" for i in range(backends)):
                self.timing_path(sid).unlink(missing_ok=True)
                self.sims[sid] = self._zygote.spawn(sid, self._sim_argv(sid, 0))
                self.ports[sid] = int(self.sims[sid].ready.rsplit(":", 1)[1])
                self.up_since[sid] = time.monotonic()
        except BaseException:
            self.close()
            raise

    def timing_path(self, sid: str) -> Path:
        """The sim's own per-request TTFT log, kept across its restarts (appended)."""
        return self._logdir / f"failover.{sid}.timing.jsonl"

    def _sim_argv(self, sid: str, port: int) -> list[str]:
        """The sim's own arguments (what follows `python -m sim`), for the zygote."""
        timing = ("--timing-log", str(self.timing_path(sid)))
        return sim_argv(f"127.0.0.1:{port}", *timing, *self._sim_extra)[1:]

    def _start(self, name: str, argv: list[str]) -> Part:
        """A part other than the fleet's sims (those come from the zygote)."""
        # Parts log to files: a warning per failover must not garble the table.
        with (self._logdir / f"failover.{name}.log").open("ab") as log:
            part = Part(name, argv, stderr=log.fileno())
        with self._lock:
            self._others.append(part)
        return part

    def kill(self, sid: str) -> float:
        """SIGKILL the sim's process group; returns the monotonic time just before the signal."""
        with self._lock:
            self.up_since[sid] = None
            part = self.sims[sid]
        at = time.monotonic()
        part.kill()  # waits for the exit
        return at

    def restart(self, sid: str) -> bool:
        """Same port, so control's registry entry stays valid; the port can be briefly busy."""
        for _ in range(RESTART_TRIES):
            if self._closed:
                return False
            try:
                part = self._zygote.spawn(sid, self._sim_argv(sid, self.ports[sid]))
            except StartFailed:
                time.sleep(0.25)
                continue
            with self._lock:
                if self._closed:  # closed while we were starting: do not leak it
                    part.stop(1.0)
                    return False
                self.sims[sid] = part
                self.up_since[sid] = time.monotonic()
            return True
        return False

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            parts: list[Part | Forked] = [*reversed(self._others), *self.sims.values()]
        for part in parts:
            with contextlib.suppress(Exception):
                part.stop(3.0)
        self._zygote.close()


def fleet_toml(sims: Mapping[str, Forked], backend_keys: Mapping[str, str] | None = None) -> str:
    """`backend_keys`: string keys added to every [[backends]] table (after its kind line,
    the last one control_toml writes)."""
    toml = control_toml({sid: p.ready for sid, p in sims.items()}, probe_interval=PROBE_INTERVAL)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (backend_keys or {}).items())
    return toml.replace('kind = "vllm"\n', 'kind = "vllm"\n' + extra) if extra else toml


@dataclass(slots=True)
class KillLog:
    kills: list[tuple[float, str]]  # (monotonic time of the SIGKILL, sim id)
    restarts: list[tuple[float, str, bool]]  # (monotonic time it was up or gave up, id, ok)
    skipped: int = 0  # planned kills with no eligible victim


async def chaos(
    fleet: Fleet,
    schedule: Sequence[Kill],
    stop: asyncio.Event,
    log: KillLog,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run the schedule until `stop` is set or it runs out; then wait for pending restarts, so
    the fleet is whole again (bounded: each restart tries RESTART_TRIES times)."""
    t0 = clock()
    async with asyncio.TaskGroup() as tg:
        for k in schedule:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, t0 + k.at - clock()))
            if stop.is_set():
                break
            victim = pick(k.draw, eligible(fleet.up_since, clock(), SETTLE_S))
            if victim is None:
                log.skipped += 1
                continue
            log.kills.append((await asyncio.to_thread(fleet.kill, victim), victim))
            tg.create_task(_restart_later(fleet, victim, k.restart_after, log, clock))


async def _restart_later(
    fleet: Fleet, sid: str, delay: float, log: KillLog, clock: Callable[[], float]
) -> None:
    await asyncio.sleep(delay)
    ok = await asyncio.to_thread(fleet.restart, sid)
    log.restarts.append((clock(), sid, ok))


# -- the client ------------------------------------------------------------------------------------
@dataclass(slots=True)
class StreamRecord:
    prompt: int  # index into the prompt list
    rid: str = ""  # X-Request-Id: joins the stream with its failover events
    status: int = 0
    text: str = ""
    done: bool = False
    error: str = ""  # the error event, or the exception the client got
    start: float = 0.0  # monotonic
    end: float = 0.0
    # Seconds after `start` at which each text chunk arrived; the sim and the shim send one
    # chunk per token, so index k is generated token k and a resume's seam is at tokens_sent.
    arrivals: list[float] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.status != 200 or self.error:
            return "failed"
        return "completed" if self.done else "truncated"

    def add(self, text: str, now: float) -> None:
        self.text += text
        self.arrivals.append(now - self.start)


class Streamed(Protocol):
    """What one client stream records of itself (StreamRecord; the agent bench's Turn)."""

    rid: str
    status: int
    done: bool
    error: str
    start: float
    end: float


async def sse_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    rec: Streamed,
    on_object: Callable[[dict[str, Any]], None],
) -> None:
    """POST `body` to `url` (a full endpoint URL) and hand each streamed JSON object to
    `on_object`; the status, request id, [DONE], an error event or the exception the client
    got, and the times go into `rec`. Never raises."""
    rec.start = time.monotonic()
    try:
        async with session.post(url, json=body) as resp:
            rec.status, rec.rid = resp.status, resp.headers.get("X-Request-Id", "")
            if resp.status != 200:
                rec.error = (await resp.text())[:300]
                return
            async for line in resp.content:
                data = line.strip().removeprefix(b"data: ")
                if data == b"[DONE]":
                    rec.done = True
                elif data.startswith(b"{"):
                    obj = orjson.loads(data)
                    if "error" in obj:
                        rec.error = data.decode()
                    on_object(obj)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: bad JSON
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.end = time.monotonic()


async def stream_one(
    session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], rec: StreamRecord
) -> StreamRecord:
    """One streaming completion; fills `rec` with what the client saw, never raises."""

    def text(obj: dict[str, Any]) -> None:
        for ch in obj.get("choices") or ():
            if ch.get("text"):
                rec.add(ch["text"], time.monotonic())

    await sse_stream(session, url + "/v1/completions", body, rec, text)
    return rec


async def load(
    session: aiohttp.ClientSession,
    n: int,
    conc: int,
    tokens: int,
    prompts: Sequence[str],
    url: Callable[[int], str],
) -> list[StreamRecord]:
    """n greedy streams, closed loop at `conc`; request i sends prompt i % len(prompts) to
    base URL `url(i)`."""
    out: list[StreamRecord] = []
    counter = iter(range(n))  # shared: each worker takes the next request index

    async def worker() -> None:
        for i in counter:
            p = i % len(prompts)
            body = {"model": MODEL, "prompt": prompts[p], "max_tokens": tokens,
                    "temperature": 0, "stream": True}  # fmt: skip
            out.append(await stream_one(session, url(i), body, StreamRecord(p)))

    async with asyncio.TaskGroup() as tg:
        for _ in range(conc):
            tg.create_task(worker())
    return out


def failover_events(control: str, settle_s: float = 0.5, tries: int = 10) -> list[dict[str, Any]]:
    """Through the real CLI; reports reach control asynchronously, so read until stable."""
    cli = "-m clients.cli events --kind failover --json --limit 100000 --control".split()
    argv = [sys.executable, *cli, control]
    last: list[dict[str, Any]] | None = None
    for _ in range(tries):
        time.sleep(settle_s)
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
        now: list[dict[str, Any]] = json.loads(out.stdout)
        if last is not None and len(now) == len(last):
            return now
        last = now
    return last or []


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # minus idle and iowait


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Fraction of all cores busy between two `machine_busy` samples: whether the machine,
    which every part here shares, was saturated."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")
