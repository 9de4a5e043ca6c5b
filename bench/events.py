"""What the audit log costs control's routing: routes per second with events off, kept in
memory, and kept in memory + appended to the durable file, in one process and one run.

Usage: python -m bench.events [--routes N] [--reps R] [--json PATH]
       python -m bench.events --instructions   (needs valgrind)

Wall-clock routes/s move with whatever else the machine runs. `--instructions` counts CPU
instructions instead (valgrind's callgrind, repeatable under any load): each variant runs at
two sizes, and the difference divided by the extra routes is the cost of one route, start-up
excluded.

This measures control's own routing path (policy + load + pins + audit event), without gRPC
in front, so the events' share is as large as it can look: through the RouteStream each
route also pays ~60-250 us of gRPC, next to which the event is smaller still."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from baton.model import RequestOutcome, RequestShape, RouteRequest
from control.audit.durable import EventFile
from control.audit.log import EventLog
from control.audit.payloads import Payload
from control.backend_spec import make_backend
from control.fleet.registry import Registry
from control.routing.policy import make_policy
from control.routing.router import Router


class NoEvents(EventLog):
    """Events off: the baseline the issue's 10% is measured against."""

    def record(self, payload: Payload, *, request_id: str = "", backend_id: str = "") -> Any:
        return None

    def record_route(self, request_id: str, backend_id: str, reason: str, policy: str,
                     model: str, pin_depth: int, snapshot: int, detail: str = "",
                     tenant: str = "") -> None:  # fmt: skip
        return None


def routes_per_second(events: EventLog, n: int, store: EventFile | None = None) -> float:
    backends = [make_backend(f"b{i}", f"http://127.0.0.1:{9000 + i}", "m") for i in range(4)]
    registry = Registry(backends, clock=time.time, events=events)
    router = Router(registry, make_policy("adaptive"), clock=time.time)
    shapes = [
        RequestShape(model="m", message_count=3, prefix_chain=(b"s" * 16, b"u%015d" % i, b"x" * 16),
                     assistant_turns=(False, False, False))
        for i in range(64)
    ]  # fmt: skip
    started = time.perf_counter()
    for i in range(n):
        rid = f"r{i}"
        decision = router.route(RouteRequest(rid, shapes[i % 64]))
        router.finished([RequestOutcome(request_id=rid, backend_id=decision.backends[0].id,
                                         model="m", ok=True, http_status=200)])
        if store is not None and i % 1000 == 999:
            store.flush()  # control flushes every 0.2 s; its cost counts here too
    return n / (time.perf_counter() - started)


def one_variant(variant: str, n: int) -> None:
    """What each callgrind child runs: `n` routes with one audit variant."""
    if variant == "off":
        routes_per_second(NoEvents(time.time), n)
    elif variant == "memory":
        routes_per_second(EventLog(time.time), n)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            store = EventFile(Path(tmp) / "events.jsonl")
            routes_per_second(EventLog(time.time, sink=store.append), n, store)
            store.close()


def instructions(variant: str, n: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
             sys.executable, "-m", "bench.events", "--variant", variant, "--routes", str(n)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"no callgrind total in: {out.stderr[-500:]}")
    return int(found.group(1))


def by_instructions(small: int, large: int, json_path: Path) -> int:
    per_route = {
        v: (instructions(v, large) - instructions(v, small)) / (large - small)
        for v in ("off", "memory", "durable")
    }
    print(f"{'audit events':<14}{'instructions/route':>20}{'vs off':>10}")
    for name, value in per_route.items():
        print(f"{name:<14}{value:>20,.0f}{value / per_route['off']:>10.3f}")
    cost = 1 - per_route["off"] / per_route["durable"]
    verdict = "PASS" if cost <= 0.10 else "FAIL"
    print(f"\n{verdict}  durable audit log costs {cost:.1%} of routing throughput "
          "(instructions, <= 10%)")  # fmt: skip
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"instructions_per_route": per_route, "cost": cost}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.events",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--routes", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/events.json"))
    parser.add_argument("--instructions", action="store_true", help="count, don't time")
    parser.add_argument("--variant", choices=("off", "memory", "durable"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        one_variant(args.variant, args.routes)
        return 0
    if args.instructions:
        return by_instructions(2_000, 12_000, args.json.with_suffix(".instructions.json"))
    runs: dict[str, list[float]] = {"off": [], "memory": [], "durable": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):  # interleaved, so drift hits every variant alike
            runs["off"].append(routes_per_second(NoEvents(time.time), args.routes))
            runs["memory"].append(routes_per_second(EventLog(time.time), args.routes))
            store = EventFile(Path(tmp) / f"events-{rep}.jsonl")
            runs["durable"].append(
                routes_per_second(EventLog(time.time, sink=store.append), args.routes, store)
            )
            store.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"{'audit events':<14}{'routes/s (median)':>20}{'vs off':>10}")
    for name, value in med.items():
        print(f"{name:<14}{value:>20,.0f}{value / med['off']:>10.3f}")
    cost = 1 - med["durable"] / med["off"]
    verdict = "PASS" if cost <= 0.10 else "FAIL"
    print(f"\n{verdict}  durable audit log costs {cost:.1%} of routing throughput (<= 10%)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": runs, "median": med, "cost": cost}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
