"""bench/lora.py's workload and client: which adapter each request names (Zipf popularity,
seeded, the same sequence for every mode) and a closed loop of streamed completions that
records each request's TTFT at the client.

Closed loop: `concurrency` workers each send their next request when the last one ended,
taking requests from one shared sequence in order. A mode that makes requests wait therefore
also sends fewer of them at once, which flatters its tail (an open loop would queue more
behind it); the comparison is conservative for the router that waits less."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from random import Random

import aiohttp
import orjson

from bench import stats


def adapter_names(n: int) -> list[str]:
    """Popularity rank i (0 = most popular) is adapter `lora-ii`."""
    return [f"lora-{i:02d}" for i in range(n)]


def zipf_weights(n: int, exponent: float) -> list[float]:
    """P(rank i) proportional to 1 / (i + 1)^exponent, normalised."""
    raw = [1.0 / (i + 1) ** exponent for i in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def request_sequence(names: Sequence[str], exponent: float, n: int, seed: int) -> list[str]:
    """The adapter each of `n` requests names, in sending order."""
    rng = Random(seed)
    return rng.choices(list(names), weights=zipf_weights(len(names), exponent), k=n)


@dataclass(frozen=True, slots=True)
class Outcome:
    adapter: str
    ttft_ms: float  # first streamed token at the client; NaN on error
    latency_ms: float
    error: str | None


@dataclass(frozen=True, slots=True)
class Load:
    concurrency: int
    max_tokens: int = 16
    timeout_s: float = 60.0  # per request: every request is bounded in time


def prompt(i: int, adapter: str) -> str:
    # Distinct per request: no prefix-cache luck between modes, the same text in each mode.
    return f"Ticket {i} for {adapter}: the router sent the request to the replica and"


async def _one(
    session: aiohttp.ClientSession, url: str, i: int, adapter: str, load: Load
) -> Outcome:
    body = orjson.dumps({"model": adapter, "prompt": prompt(i, adapter), "stream": True,
                         "max_tokens": load.max_tokens, "temperature": 0,
                         "ignore_eos": True})  # fmt: skip
    t0 = time.perf_counter()
    first: float | None = None
    try:
        async with session.post(url, data=body) as resp:
            if resp.status != 200:
                await resp.read()
                return Outcome(adapter, stats.NAN, stats.NAN, f"status {resp.status}")
            tail = b""
            async for chunk in resp.content.iter_any():
                if first is None and b'"text"' in tail + chunk:
                    first = (time.perf_counter() - t0) * 1e3
                tail = (tail + chunk)[-32:]
            if first is None or not tail.rstrip().endswith(b"[DONE]"):
                return Outcome(adapter, stats.NAN, stats.NAN, "stream not ended")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(adapter, stats.NAN, stats.NAN, type(exc).__name__)
    return Outcome(adapter, first, (time.perf_counter() - t0) * 1e3, None)


async def closed_loop(base: str, sequence: Sequence[str], load: Load) -> list[Outcome]:
    """Every request of `sequence` through `base`, `load.concurrency` at a time; outcomes in
    sequence order."""
    url = base.rstrip("/") + "/v1/completions"
    out: list[Outcome | None] = [None] * len(sequence)
    next_i = iter(range(len(sequence)))
    connector = aiohttp.TCPConnector(limit=load.concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=load.timeout_s, sock_connect=5)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     headers=headers) as session:  # fmt: skip

        async def worker() -> None:
            for i in next_i:  # shared iterator: each request is sent once, in order
                out[i] = await _one(session, url, i, sequence[i], load)

        async with asyncio.TaskGroup() as tg:
            for _ in range(min(load.concurrency, len(sequence))):
                tg.create_task(worker())
    return [o for o in out if o is not None]


@dataclass(frozen=True, slots=True)
class Measured:
    """One mode's run: the client's numbers and the engines' adapter loads during it.

    TTFT percentiles leave out the first `warmup` requests (the same ones in every mode): a
    fleet's first requests pay its cold start (Baton's engines start with no adapter, so
    they wait for the first loads), which would otherwise be the p99 of a short run. The
    p99 over every request is kept beside it. Loads count every request, cold start
    included."""

    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_p99_all_ms: float
    wall_s: float
    loads: float  # delta of sim:lora_loads_total summed over the sims
    warmup: int = 0
    error_kinds: Mapping[str, int] = field(default_factory=dict)
    # Control's adapter events (bench/lora_fleet.adapter_events): baton mode only.
    control_events: Mapping[str, int] = field(default_factory=dict)
    ttft_ms: Sequence[float] = ()  # every request's, in sequence order (NaN: failed)

    @property
    def control_loads(self) -> int:
        return sum(n for k, n in self.control_events.items() if k.startswith("load"))

    @property
    def loads_per_1k(self) -> float:
        return self.loads * 1000 / self.requests if self.requests else stats.NAN


def measured(outcomes: Sequence[Outcome], wall_s: float, loads: float, warmup: int) -> Measured:
    """`outcomes` in sequence order."""
    ttfts = [o.ttft_ms for o in outcomes[warmup:] if o.error is None]
    every = [o.ttft_ms for o in outcomes if o.error is None]
    errors = Counter(o.error for o in outcomes if o.error is not None)
    return Measured(len(outcomes), sum(errors.values()), stats.percentile(ttfts, 50),
                    stats.percentile(ttfts, 99), stats.percentile(every, 99), wall_s, loads,
                    warmup, dict(errors), {}, [round(o.ttft_ms, 2) for o in outcomes])  # fmt: skip
