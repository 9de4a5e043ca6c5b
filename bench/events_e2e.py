"""What route audit events cost control as a service: routes/s through its RouteStream, with
`[audit] route_events` on and off, each control a real process with a durable --data-dir.

Usage: python -m bench.events_e2e [--seconds S] [--reps R] [--batch B] [--json PATH]

The client batches like a busy shim (B routes per message, the previous batch's outcomes
riding along), so control, not the client, is what saturates."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from baton.v1 import routing_pb2, routing_pb2_grpc
from bench.cpu import cpu_seconds
from clients.procs import Part

CONFIG = """routing = "adaptive"
[audit]
route_events = {on}
[probes]
interval = 100000.0
{backends}"""


def config(on: bool) -> str:
    backends = "".join(
        f'[[backends]]\nid = "b{i}"\nurl = "http://127.0.0.1:{9 + i}"\nmodel = "m"\n'
        for i in range(4)
    )
    return CONFIG.format(on="true" if on else "false", backends=backends)


async def drive(target: str, seconds: float, batch: int) -> int:
    """Routes answered in `seconds`, a few batches in flight at once."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = routing_pb2_grpc.RoutingServiceStub(channel).RouteStream()
        done = 0
        sent = 0
        deadline = time.perf_counter() + seconds

        def message(n: int) -> routing_pb2.RouteStreamRequest:
            routes = [
                routing_pb2.RouteRequest(
                    request_id=f"r{n}-{i}",
                    shape=routing_pb2.RequestShape(
                        model="m",
                        message_count=2,
                        prefix_chain=[b"system-prompt-hash", b"user-%d" % (i % 97)],
                        assistant_turns=[False, False],
                    ),
                )
                for i in range(batch)
            ]
            ok = routing_pb2.OUTCOME_OK
            outcomes = [
                routing_pb2.RequestOutcome(request_id=f"r{n - 4}-{i}", outcome=ok)
                for i in range(batch)
            ] if n >= 4 else []  # fmt: skip
            return routing_pb2.RouteStreamRequest(routes=routes, outcomes=outcomes)

        for _ in range(4):  # keep 4 batches in flight
            await call.write(message(sent))
            sent += 1
        async for resp in call:
            done += len(resp.results)
            if time.perf_counter() >= deadline:
                break
            await call.write(message(sent))
            sent += 1
        call.cancel()
        return done


def run_one(on: bool, seconds: float, batch: int, tmp: Path) -> tuple[float, float]:
    """(routes/s, control CPU microseconds per route) for one fresh control."""
    path = tmp / f"control-{'on' if on else 'off'}.toml"
    path.write_text(config(on))
    data = tmp / f"data-{time.monotonic_ns()}"
    part = Part("control", ["control", "--config", str(path), "--listen", "127.0.0.1:0",
                            "--metrics-listen", "", "--data-dir", str(data)])  # fmt: skip
    try:
        asyncio.run(drive(part.ready, 0.5, batch))  # warm-up
        cpu0 = cpu_seconds(part.proc.pid)
        t0 = time.perf_counter()
        routes = asyncio.run(drive(part.ready, seconds, batch))
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds(part.proc.pid) - cpu0
    finally:
        part.stop()
    return routes / elapsed, cpu / routes * 1e6  # CPU microseconds per route


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.events_e2e", description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", type=Path, default=Path("bench/results/events_e2e.json"))
    args = parser.parse_args(argv)
    rps: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):  # interleaved
            for name, on in (("off", False), ("on", True)):
                r, c = run_one(on, args.seconds, args.batch, Path(tmp))
                rps[name].append(r)
                cpu[name].append(c)
    med = {k: statistics.median(v) for k, v in rps.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"{'route events':<14}{'routes/s (median)':>20}{'control CPU us/route':>24}")
    for name in ("off", "on"):
        print(f"{name:<14}{med[name]:>20,.0f}{cpu_med[name]:>24.1f}")
    cost = 1 - med["on"] / med["off"]
    verdict = "PASS" if cost <= 0.10 else "FAIL"
    print(
        f"\n{verdict}  durable route events cost {cost:.1%} of control's routing throughput"
        " through RouteStream (<= 10%)"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rps": rps, "cpu_us_per_route": cpu, "cost": cost}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
