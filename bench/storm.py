"""`python -m bench.storm`: a storm of streaming requests against one shim, far past what it
admits, and how its probes and its costs hold up meanwhile.

Two parts, each usable alone:

- `storm()` (also what tests/integration/test_health_storm.py runs in a process of its own):
  N clients that each send a streaming chat request, read the answer to its end and send
  the next, until a deadline or a count. Every answer is judged: served (200, `[DONE]`, a
  finish and no error event), shed (a clean OpenAI-shaped 429 with Retry-After), or bad
  (anything else: a cut stream, another status, an error event). Prints one JSON object.
- `main()`: a fleet of sims, control and one shim, with the storm beside a probe that polls
  the shim's `/health/live` through the front door (a new connection each time, as a
  kubelet does) and through the event loop (a kept-alive connection, where the shim's HTTP
  server answers it: what every probe got before the front door), and control's gRPC health
  and metrics port. Prints a table (and JSON) of the probes' latencies, and the shim's CPU
  time per shed request next to one served, each from a run that only sheds or only serves.

Quote medians and ratios: absolute times are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.cpu import cpu_seconds
from bench.parts import MODEL, control_argv, control_toml, shim_argv, sim_argv
from clients.procs import Part

HEADERS = {"Content-Type": "application/json"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "storm"}],
        "max_tokens": 16, "temperature": 0, "stream": True}  # fmt: skip


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> str:
    try:
        async with session.post(url, data=body, headers=HEADERS) as resp:
            data = await resp.read()
            if resp.status == 429:
                error = orjson.loads(data).get("error") or {}
                clean = error.get("type") == "rate_limit_error" and "Retry-After" in resp.headers
                return "shed" if clean else "bad:429 without an OpenAI error and Retry-After"
            if resp.status != 200:
                return f"bad:{resp.status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"bad:{type(exc).__name__}"
    events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return "bad:stream cut (no [DONE])"
    chunks = [orjson.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return "bad:error event"
    finishes = [ch.get("finish_reason") for c in chunks for ch in c.get("choices") or ()]
    return "served" if any(finishes) else "bad:no finish_reason"


async def storm(
    base: str, concurrency: int, seconds: float, limit: int, body: dict[str, Any]
) -> dict[str, Any]:
    """`concurrency` clients, each one request at a time, until `seconds` pass or `limit`
    requests have been sent in all (bounded both ways)."""
    url = base + "/v1/chat/completions"
    raw = orjson.dumps(body)
    outcomes: Counter[str] = Counter()
    sent = 0
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            nonlocal sent
            while time.monotonic() < deadline and sent < limit:
                sent += 1
                outcomes[await _one(session, url, raw)] += 1

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    return {"sent": sent, "elapsed_s": round(elapsed, 3), "outcomes": dict(outcomes)}


# -- probes ---------------------------------------------------------------------------------


@dataclass
class Probe:
    """Polls one URL path on a thread until stopped: (seconds since start, status, latency)."""

    host: str
    port: int
    path: str
    keep_alive: bool = False  # one connection for every poll (the shim's event loop answers)
    interval: float = 0.02
    timeout: float = 5.0
    samples: list[tuple[float, int, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Probe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout + 1)

    def _run(self) -> None:
        t0 = time.monotonic()
        conn: http.client.HTTPConnection | None = None
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                if conn is None or not self.keep_alive:
                    conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                    if self.keep_alive:
                        # Something else first: the front door passes the connection on,
                        # and from then on the shim's HTTP server answers on it.
                        conn.request("GET", "/v1/models")
                        conn.getresponse().read()
                conn.request("GET", self.path, headers={} if self.keep_alive else
                             {"Connection": "close"})  # fmt: skip
                resp = conn.getresponse()
                resp.read()
                status = resp.status
            except OSError:
                status, conn = 0, None
            took = time.monotonic() - start
            self.samples.append((start - t0, status, took))
            if not self.keep_alive and conn is not None:
                conn.close()
                conn = None
            self._stop.wait(max(0.0, self.interval - took))

    def latencies(self) -> list[float]:
        return [t for _, _, t in self.samples]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(1000 * statistics.median(values), 2) if values else float("nan"),
        "p99_ms": round(1000 * percentile(values, 0.99), 2),
        "max_ms": round(1000 * max(values), 2) if values else float("nan"),
    }


def grpc_health_probe(
    target: str, samples: list[float], stop: threading.Event, failed: list[str] | None = None
) -> None:
    """control's gRPC health Check, every 20 ms, on one channel (as a grpc_health_probe):
    each answer's latency into `samples` (a failed Check counts 5 s there), and what was
    wrong with any answer that was not SERVING into `failed`."""
    import grpc  # noqa: PLC0415 - only the control probe needs it
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    failed = failed if failed is not None else []
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            start = time.monotonic()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # type: ignore[attr-defined]
                samples.append(time.monotonic() - start)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    failed.append(f"status {reply.status}")
            except grpc.RpcError as exc:
                samples.append(5.0)
                failed.append(str(exc.code()))
            stop.wait(0.02)


# -- the bench -------------------------------------------------------------------------------


def _run_storm_process(base: str, concurrency: int, seconds: float, limit: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.storm", "--storm", base, "--concurrency", str(concurrency),
         "--seconds", str(seconds), "--limit", str(limit)],
        capture_output=True, text=True, timeout=seconds + 180, check=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout))


@contextlib.contextmanager
def bench_fleet(tmp: Path, cap: int, sims: int = 2) -> Iterator[tuple[Part, Part]]:
    """Sims (2 ms a decode step), control and one shim capped at `cap` requests in flight:
    (control, shim)."""
    parts: list[Part] = []
    try:
        urls = {}
        for i in range(sims):
            sim = Part("sim", sim_argv("127.0.0.1:0", "--decode-ms-per-step", "2"))
            parts.append(sim)
            urls[f"s{i}"] = sim.ready
        config = tmp / "control.toml"
        config.write_text(control_toml(urls, probe_interval=0.5))
        control = Part("control", control_argv(str(config)))
        parts.append(control)
        shim = Part("shim", [*shim_argv(control.ready), "--max-streams", str(cap)])
        parts.append(shim)
        yield control, shim
    finally:
        for part in reversed(parts):
            part.stop(grace=5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.storm", description=__doc__.split("\n\n")[0])
    p.add_argument("--storm", metavar="BASE", help="only the storm, against BASE (one JSON line)")
    p.add_argument("--concurrency", type=int, default=640)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--limit", type=int, default=20_000)
    p.add_argument("--cap", type=int, default=64, help="the shim's --max-streams")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--extra-probe", default="", metavar="HOST:PORT",
                   help="also probe GET / there (a bare listener, for comparison)")
    args = p.parse_args(argv)
    if args.storm:
        result = asyncio.run(storm(args.storm, args.concurrency, args.seconds, args.limit, BODY))
        print(json.dumps(result))
        return 0
    report: dict[str, Any] = {"concurrency": args.concurrency, "cap": args.cap}
    with tempfile.TemporaryDirectory() as tmp, bench_fleet(Path(tmp), args.cap) as (control, shim):
        host, port = shim.ready.removeprefix("http://").rsplit(":", 1)
        probes = {
            "shim /health/live, front door": Probe(host, int(port), "/health/live"),
            "shim /health/live, event loop": Probe(host, int(port), "/health/live", True),
        }
        metrics_url = control.announced.get("METRICS", "")  # http://HOST:PORT/metrics
        if metrics_url:
            where = metrics_url.removeprefix("http://").split("/")[0]
            m_host, m_port = where.rsplit(":", 1)
            probes["control metrics port"] = Probe(m_host, int(m_port), "/metrics")
        if args.extra_probe:
            e_host, e_port = args.extra_probe.rsplit(":", 1)
            probes["bare listener (own process)"] = Probe(e_host, int(e_port), "/")
        control_samples: list[float] = []
        stop = threading.Event()
        grpc_thread = threading.Thread(
            target=grpc_health_probe, args=(control.ready, control_samples, stop), daemon=True
        )
        for probe in probes.values():
            probe.start()
        grpc_thread.start()
        cpu0 = cpu_seconds(shim.proc.pid)
        result = _run_storm_process(shim.ready, args.concurrency, args.seconds, args.limit)
        storm_cpu = cpu_seconds(shim.proc.pid) - cpu0
        stop.set()
        for probe in probes.values():
            probe.stop()
        grpc_thread.join(6)
        report["storm"] = result
        report["probes"] = {name: summary(pr.latencies()) for name, pr in probes.items()}
        report["probes"]["control gRPC health"] = summary(control_samples)
        # CPU per request: a run that only serves (concurrency under the cap), and one that
        # only sheds (the cap taken by long streams first).
        report["cpu_us"] = {
            "served": _cpu_per_request(shim.ready, shim.proc.pid, args.cap // 2, "served"),
            "shed": _shed_cpu(shim.ready, shim.proc.pid, args.cap),
            "storm (all requests)": round(1e6 * storm_cpu / max(1, result["sent"]), 1),
        }
    _print(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _cpu_per_request(base: str, pid: int, concurrency: int, want: str) -> float:
    before = cpu_seconds(pid)
    result = _run_storm_process(base, concurrency, 4.0, 4000)
    spent = cpu_seconds(pid) - before
    count = result["outcomes"].get(want, 0)
    return round(1e6 * spent / max(1, int(count)), 1)


def _shed_cpu(base: str, pid: int, cap: int) -> float:
    """Hold every slot with long requests that do not stream (they cost the shim nothing
    while the engine works), then measure a storm that can only be shed."""
    long_body = orjson.dumps({**BODY, "stream": False, "max_tokens": 8000})  # ~16 s each
    host, port = base.removeprefix("http://").rsplit(":", 1)

    def saturated() -> bool:
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        conn.request("GET", "/health/ready")
        body = conn.getresponse().read()
        conn.close()
        return body.startswith(b"not ready: at its in-flight cap")

    async def hold_and_storm() -> float:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            holders = [
                asyncio.ensure_future(session.post(
                    base + "/v1/chat/completions", data=long_body, headers=HEADERS))
                for _ in range(cap)
            ]  # fmt: skip
            try:
                deadline = time.monotonic() + 30
                while not await asyncio.to_thread(saturated):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the shim never reached its cap")
                    await asyncio.sleep(0.1)
                before = cpu_seconds(pid)
                shed = await asyncio.to_thread(_run_storm_process, base, 64, 4.0, 4000)
                spent = cpu_seconds(pid) - before
                if set(shed["outcomes"]) != {"shed"}:
                    raise RuntimeError(f"a shed-only storm got {shed['outcomes']}")
            finally:
                for h in holders:
                    h.cancel()
        return round(1e6 * spent / max(1, int(shed["outcomes"]["shed"])), 1)

    return asyncio.run(hold_and_storm())


def _print(report: dict[str, Any]) -> None:
    print(f"storm: {report['concurrency']} clients, shim cap {report['cap']}: "
          f"{report['storm']['outcomes']} in {report['storm']['elapsed_s']} s")  # fmt: skip
    print(f"{'probe':36} {'n':>6} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for name, s in report["probes"].items():
        print(f"{name:36} {s['n']:>6} {s['p50_ms']:>9} {s['p99_ms']:>9} {s['max_ms']:>9}")
    print("shim CPU µs per request: " + ", ".join(f"{k} {v}" for k, v in report["cpu_us"].items()))


if __name__ == "__main__":
    raise SystemExit(main())
