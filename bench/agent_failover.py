"""`python -m bench.failover --workload agent`: tool-calling agent loops through Baton while
backends are SIGKILLed mid-stream, next to plain chat streams in the same run.

The fleet is bench/chaos_fleet.py's (B forked sims, control, one shim, the same chaos schedule,
kills and restarts), with the sims in tool-call mode (`--tool-calls --tool-call-after N
--parallel-tool-calls 2`: the model writes N tokens of content, then calls the first tools
offered back to back, in hermes format; a turn that answers a tool result is plain content
and EOS) and every backend declaring `tool_parser = "hermes"`, so Baton follows the calls
across a seam.

- Agent conversations: greedy chat-completion streams offering 2 tools (tool_choice auto). A
  turn that ends with finish_reason "tool_calls" is appended to the history as the assistant
  message with its calls, then one `tool` message per call (a result that is a function of
  the call), and the next turn is asked; the loop ends at a turn that does not call (at most
  MAX_TURNS). Odd conversations say parallel_tool_calls false (one call), even ones take two.
  The call ids in the history sent are normalised to `call_<turn>_<i>`, so the next turn's
  prompt is the same whatever random ids the engine (or Baton, for a call it opened after a
  seam) made: ids are not part of what a greedy model must reproduce.
- Plain chat streams without tools, as many as the reference's agent turns: the baseline.
- Reference: every conversation and plain prompt uninterrupted, streamed straight from sim s0
  before the chaos. Chaos: all of them through the shim, shuffled together, closed loop at
  concurrency C, while sims are SIGKILLed and restarted as in `python -m bench.failover`.

A stream is assembled as the OpenAI SDK assembles it, and judged per turn against the
reference (bench/agent_judge.py): content, finish_reason, and per call its name and arguments
must be equal; the call ids the client got must be well-formed (vLLM's `chatcmpl-tool-<hex>`)
and distinct within the conversation. The resume gap is control's failover event's `gap_ms`
(failure noticed to the first resumed byte), matched to agent or plain streams by
X-Request-Id.

Prints a table and PASS/FAIL lines (benchmarks never gate) and writes JSON (the summary,
every turn the client saw, the failover events, kills and restarts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from random import Random
from typing import Any

import aiohttp

from bench import stats
from bench.agent_judge import Turn, engine_floor, report, summarize, targets
from bench.chaos_fleet import (
    Fleet,
    KillLog,
    busy_fraction,
    chaos,
    chaos_schedule,
    failover_events,
    machine_busy,
    sse_stream,
)
from bench.overhead import await_serving
from bench.parts import MODEL

DEFAULT_JSON = Path(__file__).parent / "results" / "agent_failover.json"
MAX_TURNS = 3
WORDS = (
    "amber river stone north lantern maple orbit velvet harbor cinder meadow falcon copper "
    "thistle glacier echo saffron willow beacon ember prism tundra"
).split()
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The forecast for a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a zone.",
        "parameters": {"type": "object", "required": ["zone"], "properties": {
            "zone": {"type": "string"}, "offset": {"type": "number"}}}}},
]  # fmt: skip


async def chat_stream(
    session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], rec: Turn
) -> Turn:
    """One streamed chat completion into `rec`; never raises."""

    def fold(obj: dict[str, Any]) -> None:
        if obj.get("prompt_token_ids") and not rec.prompt_ids:
            rec.prompt_ids = list(obj["prompt_token_ids"])
        for ch in obj.get("choices") or ():
            rec.fold(ch)

    await sse_stream(session, url + "/v1/chat/completions", body, rec, fold)
    return rec


def follow_up(turn: Turn) -> list[dict[str, Any]]:
    """The assistant message of a calling turn, then one tool result per call. Ids become
    call_<turn>_<i>: the engine's are random, and the next prompt must not depend on them."""
    calls: list[dict[str, Any]] = [{"id": f"call_{turn.turn}_{i}", "type": "function",
              "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
             for i, c in enumerate(turn.calls)]  # fmt: skip
    results = [{"role": "tool", "tool_call_id": c["id"],
                "content": json.dumps({"tool": c["function"]["name"], "ok": True,
                                       "size": len(c["function"]["arguments"])})}
               for c in calls]  # fmt: skip
    return [{"role": "assistant", "content": turn.message.get("content"), "tool_calls": calls},
            *results]


@dataclass(frozen=True, slots=True)
class Shape:
    """What the conversations and plain streams ask for."""

    agent_tokens: int = 256  # a turn ends by EOS well before this
    plain_tokens: int = 64

    def agent_body(self, key: int, messages: list[dict[str, Any]], ids: bool) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0,
                "max_tokens": self.agent_tokens, "stream": True,
                "parallel_tool_calls": key % 2 == 0}  # fmt: skip
        return {**body, "return_token_ids": True} if ids else body

    def plain_body(self, prompt: str, ids: bool) -> dict[str, Any]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "max_tokens": self.plain_tokens, "stream": True}  # fmt: skip
        return {**body, "return_token_ids": True} if ids else body


async def conversation(
    session: aiohttp.ClientSession, url: str, shape: Shape, key: int, prompt: str, ids: bool
) -> list[Turn]:
    """The agent loop: ask, append the calls and their results, ask again, until no call."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    turns: list[Turn] = []
    for n in range(1, MAX_TURNS + 1):
        turn = await chat_stream(session, url, shape.agent_body(key, messages, ids),
                                 Turn("agent", key, n))  # fmt: skip
        turns.append(turn)
        if turn.verdict != "completed" or turn.finish != "tool_calls" or not turn.calls:
            break
        messages = [*messages, *follow_up(turn)]
    return turns


def prompts(seed: int, count: int) -> list[str]:
    rng = Random(seed)
    return [" ".join(rng.sample(WORDS, rng.randint(3, 6))) for _ in range(count)]


async def run_jobs(
    session: aiohttp.ClientSession, url: str, shape: Shape, jobs: Sequence[tuple[str, int]],
    texts: Mapping[str, Sequence[str]], conc: int, ids: bool = False,
) -> tuple[dict[int, list[Turn]], dict[int, Turn]]:  # fmt: skip
    """Closed loop at `conc` over ("agent", i) and ("plain", j) jobs: conversations by i,
    plain streams by j."""
    convs: dict[int, list[Turn]] = {}
    plains: dict[int, Turn] = {}
    todo = iter(jobs)

    async def worker() -> None:
        for kind, i in todo:
            text = texts[kind][i % len(texts[kind])]
            if kind == "agent":
                convs[i] = await conversation(session, url, shape, i, text, ids)
            else:
                plains[i] = await chat_stream(session, url, shape.plain_body(text, ids),
                                              Turn("plain", i))  # fmt: skip

    async with asyncio.TaskGroup() as tg:
        for _ in range(conc):
            tg.create_task(worker())
    return convs, plains


# -- the run --------------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    conversations: int
    concurrency: int
    backends: int
    kill_every: float
    seed: int
    call_after: int = 16  # content tokens before the calls, and an answer turn's length
    parallel: int = 2
    prompts: int = 16


def sim_flags(plan: Plan) -> tuple[str, ...]:
    return ("--tool-calls", "--tool-call-after", str(plan.call_after),
            "--parallel-tool-calls", str(plan.parallel))  # fmt: skip


async def run(fleet: Fleet, plan: Plan) -> dict[str, Any]:
    shape, kills = Shape(), KillLog([], [])
    n_prompts = min(plan.prompts, plan.conversations)
    texts = {"agent": prompts(plan.seed, n_prompts), "plain": prompts(plan.seed + 1, n_prompts)}
    timeout = aiohttp.ClientTimeout(total=120, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        s0 = fleet.sims["s0"].ready
        # Greedy output is a function of the prompt: one reference per distinct prompt.
        ref_jobs = [("agent", i) for i in range(n_prompts)] + [("plain", i)
                                                                 for i in range(n_prompts)]
        agent_ref, plain_ref = await run_jobs(session, s0, shape, ref_jobs, texts,
                                              plan.concurrency, ids=True)  # fmt: skip
        conv_refs = {i: agent_ref[i % n_prompts] for i in range(plan.conversations)}
        n_plain = sum(len(r) for r in conv_refs.values())  # as many as the agent turns
        plain_refs = {j: plain_ref[j % n_prompts] for j in range(n_plain)}
        jobs = [("agent", i) for i in range(plan.conversations)] + [("plain", j)
                                                                      for j in range(n_plain)]
        Random(plan.seed).shuffle(jobs)
        shim = fleet.shim.ready
        # An unrecorded round first, so connection set-up is in no stream's numbers.
        await run_jobs(session, shim, shape, [("plain", j) for j in range(plan.concurrency)],
                       texts, plan.concurrency)  # fmt: skip
        stop = asyncio.Event()
        schedule = chaos_schedule(plan.seed, plan.kill_every, count=10_000)
        task = asyncio.create_task(chaos(fleet, schedule, stop, kills))
        before = machine_busy()
        try:
            convs, plains = await run_jobs(session, shim, shape, jobs, texts, plan.concurrency)
        finally:
            stop.set()  # the chaos ends with the load, and waits for its restarts
            await task
        # Whoever used the cores: on a shared machine, the gaps say more next to this.
        busy, load_avg = busy_fraction(before, machine_busy()), os.getloadavg()[0]
        events = await asyncio.to_thread(failover_events, fleet.control.ready)
    logs = {sid: read_jsonl(fleet.timing_path(sid)) for sid in fleet.sims}
    refs = {t.rid: conv_refs[i][t.turn - 1] for i, ts in convs.items() for t in ts
            if t.turn <= len(conv_refs[i])}  # fmt: skip
    refs |= {t.rid: plain_refs[j] for j, t in plains.items()}
    engine = engine_floor(events, refs, logs)
    summary = summarize(convs, conv_refs, plains, plain_refs, events, len(kills.kills), engine)
    return {
        "summary": {**summary, "machine_busy": busy, "load_avg_1m": load_avg},
        "kills": kills.kills,
        "restarts": kills.restarts,
        "skipped_kills": kills.skipped,
        "events": events,
        "turns": [asdict(t) for i in sorted(convs) for t in convs[i]],
        "plain": [asdict(plains[j]) for j in sorted(plains)],
        "reference": [asdict(t) for i in sorted(agent_ref) for t in agent_ref[i]],
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_bytes().splitlines() if path.exists() else ():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a SIGKILL
    return out


def parse_args(argv: Sequence[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(
        prog="python -m bench.failover --workload agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="16 conversations")
    p.add_argument("--conversations", type=int, help="agent conversations (default 100)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--backends", type=int, default=3)
    p.add_argument("--kill-every", type=float, default=0.4, help="mean seconds between kills")
    p.add_argument("--call-after", type=int, default=16,
                   help="content tokens before the calls (and an answer's length)")
    p.add_argument("--parallel-tool-calls", type=int, default=2, help="calls per calling turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = p.parse_args(argv)
    if a.backends < 2:
        p.error("--backends must be at least 2: a resume needs somewhere to go")
    n = a.conversations if a.conversations is not None else (16 if a.quick else 100)
    plan = Plan(n, a.concurrency, a.backends, a.kill_every, a.seed, a.call_after,
                a.parallel_tool_calls)  # fmt: skip
    return plan, a.json


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    plan, json_path = parse_args(argv)
    try:
        with Fleet(json_path.parent, plan.backends, sim_flags(plan),
                   backend_keys={"tool_parser": "hermes"}) as fleet:  # fmt: skip
            await_serving(fleet.shim.ready)
            doc = asyncio.run(run(fleet, plan))
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    out(report(doc["summary"]))
    doc["plan"] = asdict(plan)
    doc["targets"] = [{**asdict(t), "verdict": t.verdict} for t in targets(doc["summary"])]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(stats.finite(doc), allow_nan=False))
    out(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
