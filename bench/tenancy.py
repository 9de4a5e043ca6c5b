"""`python -m bench.tenancy`: what tenants, priority bands and fair share do for an
interactive tenant while a batch tenant floods the fleet, in three setups in the same run:

- `fifo`: today's default. No tenants, no [admission]: every request goes to an engine at
  once and waits in the engine's own queue, first come first served.
- `tenants`: the two tenants with their keys (interactive `app`, batch `jobs`), no
  [admission]: keys and limits only, no bands.
- `bands`: the same tenants and [admission] (a capacity per backend, headroom for the
  higher bands, a bounded wait).

The fleet: two sims that each decode at most 4 requests at once (more wait in the sim's own
queue, as vLLM's scheduler makes them), 20 ms a step. The batch tenant floods with
`--flood` clients (ten times the fleet's 8 slots by default), each streaming one 32-token
answer after another; the interactive tenant has 2 clients streaming 8-token answers one
after another. Each setup runs `--seconds`, after a warm-up. Per class: TTFT p50 and p99,
goodput (answers completed per second, and their tokens per second), and the share shed
(429 with Retry-After).

Also the cost of admission on control's route path, in process: one route decision with a
tenant at its limits' bookkeeping (concurrency, requests and tokens per minute) against one
from an open shim, best of several runs of 20,000 decisions each.

Quote ratios and medians: absolute times are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.parts import MODEL, control_argv, control_toml, shim_argv, sim_argv, starter
from bench.stats import percentile

DEFAULT_JSON = Path("bench/results/tenancy.json")
SIM = ("--max-num-seqs", "4", "--decode-ms-per-step", "20", "--prefill-us-per-token", "20")
ADMISSION = "[admission]\nbackend_capacity = 4\nheadroom = 0.125\nmax_wait = 5.0\n"
SETUPS = ("fifo", "tenants", "bands")


@dataclass
class ClassStats:
    ttft: list[float] = field(default_factory=list)
    served: int = 0
    tokens: int = 0
    shed: int = 0
    bad: dict[str, int] = field(default_factory=lambda: defaultdict(int))


async def _stream(
    session: aiohttp.ClientSession, url: str, key: str, tokens: int, stats: ClassStats
) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "bench", "max_tokens": tokens,
                         "temperature": 0, "stream": True})  # fmt: skip
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    start = time.monotonic()
    first = None
    got = 0
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status == 429 and "Retry-After" in resp.headers:
                stats.shed += 1
                await resp.read()
                await asyncio.sleep(float(resp.headers["Retry-After"]))  # as a client backs off
                return
            if resp.status != 200:
                stats.bad[str(resp.status)] += 1
                await resp.read()
                return
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"text":""' not in line:
                    got += 1
                    if first is None:
                        first = time.monotonic() - start
                elif line.startswith(b"data: [DONE]"):
                    break
    except (aiohttp.ClientError, TimeoutError) as exc:
        stats.bad[type(exc).__name__] += 1
        return
    if first is None:
        stats.bad["no token"] += 1
        return
    stats.ttft.append(first)
    stats.served += 1
    stats.tokens += got


async def _load(base: str, keys: dict[str, str], flood: int, seconds: float) -> dict[str, Any]:
    url = base + "/v1/completions"
    stats = {"interactive": ClassStats(), "batch": ClassStats()}
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def client(cls: str, tokens: int, until: float, keep: bool) -> None:
            while time.monotonic() < until:
                scratch = ClassStats()
                await _stream(session, url, keys[cls], tokens, stats[cls] if keep else scratch)

        elapsed = seconds
        for length, keep in ((2.0, False), (seconds, True)):  # a warm-up, then the measure
            began = time.monotonic()
            until = began + length
            clients = [client("batch", 32, until, keep) for _ in range(flood)]
            clients += [client("interactive", 8, until, keep) for _ in range(2)]
            await asyncio.gather(*clients)
            elapsed = time.monotonic() - began  # until the last request started in it ended
    out = {}
    for cls, s in stats.items():
        attempts = s.served + s.shed + sum(s.bad.values())
        out[cls] = {
            "ttft_p50_ms": statistics.median(s.ttft) * 1000 if s.ttft else None,
            "ttft_p99_ms": percentile(s.ttft, 99) * 1000 if s.ttft else None,
            "served_per_s": s.served / elapsed,
            "tokens_per_s": s.tokens / elapsed,
            "shed_pct": 100.0 * s.shed / attempts if attempts else 0.0,
            "bad": dict(s.bad),
        }
    return out


def _idle(base: str, key: str) -> float:
    """The interactive tenant's TTFT p50 alone on the fleet."""

    async def run() -> float:
        stats = ClassStats()
        async with aiohttp.ClientSession() as session:
            for _ in range(15):
                await _stream(session, base + "/v1/completions", key, 8, stats)
        return statistics.median(stats.ttft) * 1000

    return asyncio.run(run())


def _setup(name: str, logdir: Path, flood: int, seconds: float) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        start = starter(stack, logdir, f"tenancy-{name}")
        sims = {f"s{i}": start(f"sim{i}", sim_argv("127.0.0.1:0", *SIM)) for i in range(2)}
        toml = control_toml({k: p.ready for k, p in sims.items()}, routing="roundrobin")
        if name == "bands":
            toml += "\n" + ADMISSION
        config = logdir / f"tenancy-{name}.toml"
        config.write_text(toml)
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        keys = {"interactive": "open", "batch": "open"}
        if name != "fifo":
            for cls, tid in (("interactive", "app"), ("batch", "jobs")):
                keys[cls] = _add_tenant(control.ready, tid, cls)
            _wait_key(shim.ready, keys["interactive"])
        idle = _idle(shim.ready, keys["interactive"])
        result = asyncio.run(_load(shim.ready, keys, flood, seconds))
        result["interactive"]["idle_ttft_p50_ms"] = idle
        return result


def _add_tenant(control: str, tid: str, priority: str) -> str:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", "tenants", "add", tid, "--priority", priority,
         "--control", control, "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return str(json.loads(out.stdout)["key"])


def _wait_key(base: str, key: str) -> None:
    async def ok() -> bool:
        stats = ClassStats()
        async with aiohttp.ClientSession() as session:
            await _stream(session, base + "/v1/completions", key, 1, stats)
        return stats.served == 1

    deadline = time.monotonic() + 10
    while not asyncio.run(ok()):
        if time.monotonic() > deadline:
            raise SystemExit("the shim never took the tenant's key")
        time.sleep(0.1)


def admission_cost(decisions: int = 20_000, reps: int = 5) -> dict[str, float]:
    """µs per route decision in control's router, with a tenant's limits and without."""
    from baton import model as m
    from baton.tenancy import Limits, Tenant, digest
    from control.fleet.registry import Registry
    from control.routing.policy import make_policy
    from control.routing.router import Router

    backends = [m.Backend(m.BackendId(f"b{i}"), f"http://127.0.0.1:{9000 + i}", MODEL,
                          m.BackendKind.VLLM, m.Role.SERVE) for i in range(4)]  # fmt: skip
    limits = Limits(concurrent=10_000, requests_per_minute=10**9, tokens_per_minute=10**12)

    def run(tenant: str) -> float:
        clock = iter(range(10**9)).__next__
        registry = Registry(backends, clock=lambda: float(clock()) * 1e-4)
        registry.tenants.add(Tenant("acme", limits=limits), digest("k"), now=0.0)
        router = Router(registry, make_policy("roundrobin"),
                        clock=lambda: float(clock()) * 1e-4, route_events=False)  # fmt: skip
        shape = m.RequestShape(MODEL, prompt_chars=400, tenant=tenant, max_tokens=64)
        start = time.perf_counter()
        for i in range(decisions):
            rid = str(i)
            router.route(m.RouteRequest(rid, shape))
            router.finished([m.RequestOutcome(request_id=rid, backend_id="b0", model=MODEL,
                                              ok=True, http_status=200, prompt_tokens=100,
                                              completion_tokens=64)])  # fmt: skip
        return (time.perf_counter() - start) / decisions * 1e6

    open_us = min(run("") for _ in range(reps))
    tenant_us = min(run("acme") for _ in range(reps))
    return {"open_us": open_us, "tenant_us": tenant_us, "admission_us": tenant_us - open_us}


def report(results: dict[str, dict[str, Any]], cost: dict[str, float]) -> str:
    def f(v: Any, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = ["| setup | class | TTFT p50 ms | TTFT p99 ms | served/s | tokens/s | shed % |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in SETUPS:
        r = results[name]
        for cls in ("interactive", "batch"):
            c = r[cls]
            lines.append(f"| {name} | {cls} | {f(c['ttft_p50_ms'])} | {f(c['ttft_p99_ms'])} | "
                         f"{f(c['served_per_s'])} | {f(c['tokens_per_s'], '{:.0f}')} | "
                         f"{f(c['shed_pct'])} |")  # fmt: skip
    lines.append("")
    for name in SETUPS:
        c = results[name]["interactive"]
        idle, busy = c["idle_ttft_p50_ms"], c["ttft_p50_ms"]
        ratio = f"{busy / idle:.2f}x" if busy and idle else "-"
        lines.append(f"{name}: interactive TTFT p50 under the flood / idle = {ratio} "
                     f"(idle {idle:.1f} ms)")  # fmt: skip
    lines.append(f"\nadmission on control's route path: {cost['admission_us']:.1f} µs a "
                 f"decision ({cost['tenant_us']:.1f} with a tenant's limits, "
                 f"{cost['open_us']:.1f} without)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tenancy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="4 s per setup, 40 batch clients")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--flood", type=int, default=80, help="batch clients (the fleet has 8 slots)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    seconds = 4.0 if args.quick else args.seconds
    flood = 40 if args.quick else args.flood
    args.json.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-tenancy-") as tmp:
        for name in SETUPS:
            results[name] = _setup(name, Path(tmp), flood, seconds)
    cost = admission_cost(5_000 if args.quick else 20_000)
    print(report(results, cost))
    doc = {"plan": {"seconds": seconds, "flood": flood, "sim": list(SIM),
                    "admission": ADMISSION}, "setups": results, "admission_cost": cost}  # fmt: skip
    args.json.write_text(json.dumps(doc, allow_nan=False, default=str))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
