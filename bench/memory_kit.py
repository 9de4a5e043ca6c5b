"""What bench.memory reads, drives and prints: a process's resident memory through /proc (Linux
only); the two kinds of client it measures a router with, streams read to the end (counted in
SSE events) and streams whose client reads the head of the answer and then stops reading; and
the summary of its runs, as a table."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from bench import stats


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(f"no {field} in /proc/{pid}/status")


def rss_kb(pid: int) -> int:
    """Resident set size now (VmRSS), KiB."""
    return _status_kb(pid, "VmRSS")


def hwm_kb(pid: int) -> int:
    """The resident set's high-water mark (VmHWM), KiB."""
    return _status_kb(pid, "VmHWM")


def reset_hwm(pid: int) -> bool:
    """Resets VmHWM to the current RSS (`5` into /proc/PID/clear_refs, Linux >= 4.0); False
    where the kernel or the permissions refuse, and then only sampling sees the peak."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return hwm_kb(pid) <= rss_kb(pid) + 64


class Sampler:
    """VmRSS of some processes every `period` seconds in a thread, keeping each one's maximum:
    the peak where VmHWM cannot be reset, and a check on it where it can."""

    def __init__(self, pids: Mapping[str, int], period: float = 0.02) -> None:
        self._pids = dict(pids)
        self._period = period
        self.peak_kb = {name: rss_kb(pid) for name, pid in self._pids.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            for name, pid in self._pids.items():
                with contextlib.suppress(OSError, LookupError):  # a process that ended
                    self.peak_kb[name] = max(self.peak_kb[name], rss_kb(pid))

    @contextlib.contextmanager
    def running(self) -> Iterator[Sampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(2.0)


async def settled_rss_kb(
    pid: int, flat_s: float, max_wait: float, tolerance_kb: int, period: float = 0.1
) -> tuple[int, float, bool]:
    """Waits until `pid`'s RSS moved by at most `tolerance_kb` over the last `flat_s` seconds,
    for at most `max_wait` seconds: (RSS in KiB, seconds waited, whether it went flat)."""
    start = time.monotonic()
    window: list[tuple[float, int]] = []
    while True:
        now, rss = time.monotonic(), rss_kb(pid)
        window = [(t, r) for t, r in window if t >= now - flat_s] + [(now, rss)]
        values = [r for _, r in window]
        if now - window[0][0] >= flat_s * 0.95 and max(values) - min(values) <= tolerance_kb:
            return rss, now - start, True
        if now - start >= max_wait:
            return rss, now - start, False
        await asyncio.sleep(period)


async def until(check: Callable[[], bool], max_wait: float, period: float = 0.05) -> bool:
    """Polls `check` until it holds or `max_wait` seconds pass; whether it held."""
    deadline = time.monotonic() + max_wait
    while not check():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(period)
    return True


def request(api: str, i: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """Stream i's path and body on `api` ("chat" or "completions"): greedy (a resume is
    token-exact), a prompt of its own."""
    ask = f"stream {i}: tell me a long story"
    body: dict[str, Any] = {"model": "toy", "stream": True, "max_tokens": max_tokens,
                            "temperature": 0}  # fmt: skip
    if api == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": ask}]}
    return "/v1/completions", {**body, "prompt": ask}


class Readers:
    """n streams, each read to its end as fast as it comes; `events[i]` counts the SSE events
    stream i delivered (a blank line ends each one; the sim sends one event per token, and a
    chat stream's first event is its role, so before [DONE] that is the tokens the client
    holds, plus one on chat). Ended by `close()`."""

    def __init__(self, url: str, n: int, max_tokens: int, api: str) -> None:
        self.events = [0] * n
        self.errors: list[str] = []
        self.done = 0
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                              connector=aiohttp.TCPConnector(limit=0))  # fmt: skip
        self._tasks = [asyncio.create_task(self._read(url, i, max_tokens, api)) for i in range(n)]

    async def _read(self, url: str, i: int, max_tokens: int, api: str) -> None:
        path, body = request(api, i, max_tokens)
        try:
            async with self._session.post(url + path, json=body) as resp:
                if resp.status != 200:
                    self.errors.append(f"{resp.status}: {(await resp.text())[:200]}")
                    return
                last = b""
                async for chunk in resp.content.iter_any():
                    self.events[i] += (last + chunk).count(b"\n\n")  # `last`: one byte
                    last = chunk[-1:]
                self.done += 1
        except (aiohttp.ClientError, OSError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()


class Stalled:
    """n streamed completions over raw connections whose client reads the response head and
    `head_bytes` of the body, then never reads again and keeps the socket open: what reaches
    the router is the kernel's flow control, as from a client that stopped reading."""

    def __init__(self, url: str, n: int, max_tokens: int, head_bytes: int, api: str) -> None:
        parts = urlsplit(url)
        self._addr = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._head_bytes = head_bytes
        self.started = 0
        self.errors: list[str] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks = [asyncio.create_task(self._open(i, max_tokens, api)) for i in range(n)]

    async def _open(self, i: int, max_tokens: int, api: str) -> None:
        path, fields = request(api, i, max_tokens)
        body = orjson.dumps(fields)
        host = f"{self._addr[0]}:{self._addr[1]}"
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
        try:
            reader, writer = await asyncio.open_connection(*self._addr)
            self._writers.append(writer)
            writer.write(head.encode() + body)
            status = await reader.readuntil(b"\r\n\r\n")
            if not status.startswith(b"HTTP/1.1 200"):
                self.errors.append(status.split(b"\r\n", 1)[0].decode(errors="replace"))
                return
            await reader.readexactly(self._head_bytes)
            self.started += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    async def ready(self, max_wait: float) -> bool:
        """Whether every stream got its head within `max_wait` seconds."""
        done, _ = await asyncio.wait(self._tasks, timeout=max_wait)
        return len(done) == len(self._tasks)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._writers:
            w.transport.abort()


async def warm_up(url: str, rounds: int, concurrency: int, api: str) -> list[str]:
    """`rounds` rounds of `concurrency` short streams read to the end, so lazily built state
    (imports, pools, first-request caches) is in the baseline; the errors seen."""
    errors: list[str] = []
    for _ in range(rounds):
        readers = Readers(url, concurrency, 64, api)

        def over(r: Readers = readers) -> bool:
            return r.done + len(r.errors) >= concurrency

        await until(over, 30.0)
        errors += readers.errors
        await readers.close()
    return errors


def reading(
    pids: Mapping[str, int], base: Mapping[str, int], hwm_ok: Mapping[str, bool], sampler: Sampler
) -> dict[str, dict[str, float]]:
    """Each process now: RSS, peak since the baseline (the highest of VmHWM where it could be
    reset, the sampled maximum and RSS now: the kernel's counters lag by a few pages per
    thread), and both minus the baseline `base`, KiB."""
    out: dict[str, dict[str, float]] = {}
    for name, pid in pids.items():
        rss, sampled = rss_kb(pid), sampler.peak_kb[name]
        hwm = float(hwm_kb(pid)) if hwm_ok[name] else float("nan")
        peak = max(rss, sampled, 0 if math.isnan(hwm) else hwm)
        out[name] = {"baseline_kb": base[name], "rss_kb": rss, "hwm_kb": hwm,
                     "sampled_peak_kb": sampled, "held_kb": rss - base[name],
                     "peak_added_kb": peak - base[name]}  # fmt: skip
    return out


SHIM_METRICS = ("baton_shim_attempts_total", "baton_shim_failovers_total")


async def shim_metrics(url: str) -> dict[str, Any]:
    """The shim's own count of requests in flight, and its attempt and failover samples."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        text = await resp.text()
    samples = [line for line in text.splitlines() if line.startswith(SHIM_METRICS)]
    return {
        "in_flight": stats.metric_sum(text, "baton_shim_requests_in_flight"),
        "samples": samples,
    }


BATON, FLOOR = "Baton", "aiohttp floor"
NAN = float("nan")
METRICS = ("per_stream_kb", "bytes_per_token", "held_per_stream_kb", "held_bytes_per_token",
           "control_added_kb")  # fmt: skip


def summarize(cases: Sequence[Any], runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per case: each router's medians over its reps (and the two headline metrics' range),
    and Baton's medians over the floor's."""
    rows: list[dict[str, Any]] = []
    for case in cases:  # bench.memory.Case
        row: dict[str, Any] = {"case": case.name, "kind": case.kind, "api": case.api,
                               "streams": case.streams, "tokens": case.tokens,
                               "byte_level": case.byte_level}  # fmt: skip
        for target in (BATON, FLOOR):
            mine = [r for r in runs if (r["case"], r["streams"], r["target"])
                    == (case.name, case.streams, target)]  # fmt: skip
            row[target] = None
            if mine:
                t = row[target] = {k: stats.median(float(r[k]) for r in mine) for k in METRICS}
                for k in METRICS[:2]:
                    values = sorted(float(r[k]) for r in mine)
                    t[k + "_range"] = [values[0], values[-1]]
                t.update(reps=len(mine), settled=all(r["parked"] and r["flat"] for r in mine))
        b, f = row[BATON], row[FLOOR]
        row["ratio"] = {k: b[k] / f[k] if b and f and f[k] > 0 else NAN for k in METRICS[:4]}
        rows.append(row)
    return rows


def slopes(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per router, the least-squares slope of per-stream peak bytes over tokens held, across
    the read cases of chat's default output: bytes per token beyond a stream's fixed cost."""
    out: dict[str, float] = {}
    plain = [r for r in rows if r["kind"] == "read" and r["api"] == "chat" and not r["byte_level"]]
    for target in (BATON, FLOOR):
        pts = [(float(r["tokens"]), r[target]["per_stream_kb"] * 1024) for r in plain if r[target]]
        pts = [(x, y) for x, y in pts if not math.isnan(y)]
        if len({x for x, _ in pts}) < 2:
            out[target] = NAN
            continue
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        out[target] = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return out


def _num(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def _cell(t: Mapping[str, Any] | None, key: str, digits: int) -> str:
    """A router's median, with its range over the reps when there are several."""
    if t is None:
        return "n/a"
    lo, hi = t[key + "_range"]
    spread = f" ({_num(lo, digits)}-{_num(hi, digits)})" if t["reps"] > 1 else ""
    return _num(t[key], digits) + spread


def _ratio(r: Mapping[str, Any], key: str) -> str:
    value = r["ratio"][key]
    return "n/a" if r[FLOOR] is None else "-" if math.isnan(value) else f"{value:.2f}x"


HEAD = ("case", "streams x tokens", "Baton KiB/stream", "floor KiB/stream", "Baton/floor",
        "Baton B/token", "floor B/token", "Baton/floor", "control +MiB")  # fmt: skip


def render(rows: Sequence[Mapping[str, Any]], slope: Mapping[str, float]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in rows:
        b, f = r[BATON], r[FLOOR]
        settled = all(t is None or t["settled"] for t in (b, f))
        cells = [r["case"] + ("" if settled else " *"), f"{r['streams']} x {r['tokens']:,}",
                 _cell(b, "per_stream_kb", 0), _cell(f, "per_stream_kb", 0),
                 _ratio(r, "per_stream_kb")]  # fmt: skip
        if r["kind"] == "stalled":
            cells += ["-", "-", "-"]
        else:
            cells += [_cell(b, "bytes_per_token", 1), _cell(f, "bytes_per_token", 1),
                      _ratio(r, "bytes_per_token")]  # fmt: skip
        cells.append(_num(b["control_added_kb"] / 1024, 1) if b else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([
        *lines, "",
        "KiB/stream: (peak RSS - baseline) / streams; B/token: (peak RSS - baseline) / tokens",
        "the clients hold; peak: VmHWM since the baseline. Medians (min-max) over fresh-process",
        "reps; ratios of the medians. control: its own peak RSS change. *: a run did not settle.",
        f"Slope of per-stream peak bytes over tokens held (read, chat, default output): Baton "
        f"{_num(slope[BATON], 1)} B/token, floor {_num(slope[FLOOR], 1)} B/token.",
    ])  # fmt: skip
