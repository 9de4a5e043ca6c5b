"""The agent failover benchmark's records and verdicts (pure, no I/O): one chat stream as the
client assembled it, judged against its reference, and the summary, table and targets
`python -m bench.failover --workload agent` (bench/agent_failover.py) prints.

A stream is assembled as the OpenAI SDK assembles it: every chunk's delta is folded into the
message with the SDK's own `accumulate_delta` (openai.lib.streaming._deltas, what
ChatCompletionStreamState runs: strings concatenate, tool calls merge by index), so an id or a
name sent twice shows as a doubled string, as a client would get it."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from openai.lib.streaming._deltas import accumulate_delta

from bench import stats
from sim.timing import prompt_key

ID_RE = re.compile(r"chatcmpl-tool-[0-9a-f]{16,32}")  # vLLM's make_tool_call_id, and Baton's


@dataclass(slots=True)
class Turn:
    """One chat stream as the client saw it."""

    kind: str  # "agent" or "plain"
    key: int  # conversation or plain prompt index
    turn: int = 0  # 1-based within its conversation; 0 for a plain stream
    rid: str = ""  # X-Request-Id: joins the stream with its failover events
    status: int = 0
    error: str = ""
    done: bool = False
    start: float = 0.0
    end: float = 0.0
    message: dict[str, Any] = field(default_factory=dict)  # as the SDK assembles it
    finish: str | None = None
    chunks: int = 0  # chunks with content or tool calls
    ids: int = 0  # token ids seen (the reference asks for them)
    call_at: int | None = None  # token ids before the first one a chunk did not show as content
    prompt_ids: list[int] = field(default_factory=list)  # the reference's, for the engine floor
    token_ids: list[int] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.status != 200 or self.error:
            return "failed"
        return "completed" if self.done else "truncated"

    @property
    def calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])

    def fold(self, ch: Mapping[str, Any]) -> None:
        delta = ch.get("delta") or {}
        ids = ch.get("token_ids") or []
        if ids and self.call_at is None and not delta.get("content"):
            self.call_at = self.ids
        self.ids += len(ids)
        self.token_ids += ids
        if delta.get("content") or delta.get("tool_calls"):
            self.chunks += 1
        # The SDK's own fold; its types say dict[object, object], ours are JSON objects.
        accumulate_delta(cast("dict[object, object]", self.message),
                         cast("dict[object, object]", dict(delta)))  # fmt: skip
        self.finish = ch.get("finish_reason") or self.finish


def call_key(c: Mapping[str, Any]) -> tuple[str, str]:
    fn = c.get("function") or {}
    return str(fn.get("name")), str(fn.get("arguments"))


def judge(got: Turn | None, want: Turn) -> str:
    """'' when the turn is what the reference said, else the first thing that differs."""
    if got is None:
        return "missing"
    if got.verdict != "completed":
        return got.verdict
    if got.message.get("content") != want.message.get("content"):
        return "content"
    if got.finish != want.finish:
        return "finish_reason"
    if [call_key(c) for c in got.calls] != [call_key(c) for c in want.calls]:
        return "calls"
    if not all(isinstance(c.get("id"), str) and ID_RE.fullmatch(c["id"]) for c in got.calls):
        return "call_id"
    return ""


def judge_conversation(got: Sequence[Turn], want: Sequence[Turn]) -> list[str]:
    """One verdict per reference turn (and 'extra' per turn the reference did not have); a
    call id repeated within the conversation fails the turn that repeated it."""
    out = [judge(got[i] if i < len(got) else None, w) for i, w in enumerate(want)]
    out += ["extra"] * max(0, len(got) - len(want))
    seen: set[str] = set()
    for i, t in enumerate(got[: len(want)]):
        ids = [str(c.get("id")) for c in t.calls]
        if not out[i] and (len(set(ids)) < len(ids) or seen & set(ids)):
            out[i] = "duplicate_call_id"
        seen |= set(ids)
    return out


def engine_floor(
    events: Sequence[Mapping[str, Any]], refs: Mapping[str, Turn],
    logs: Mapping[str, Sequence[Mapping[str, Any]]],
) -> dict[str, list[tuple[float, float]]]:  # fmt: skip
    """(gap ms, the new backend's own TTFT ms) per resumed failover, by stream kind: the
    physics inside the gap. `refs`: each run stream's reference by X-Request-Id; the resume's
    prompt (the reference's prompt ids + the ids sent) is looked up in its target's timing log
    (sim --timing-log) and used only when it is there once."""
    by_key: dict[tuple[str, str], list[float]] = {}
    for sid, lines in logs.items():
        for line in lines:
            by_key.setdefault((sid, str(line["prompt"])), []).append(float(line["ttft_ms"]))
    out: dict[str, list[tuple[float, float]]] = {"agent": [], "plain": []}
    for e in events:
        ref = refs.get(str(e.get("request_id")))
        if e.get("outcome") != "resumed" or ref is None or not ref.prompt_ids:
            continue
        key = prompt_key([*ref.prompt_ids, *ref.token_ids[: int(e["tokens_sent"])]])
        found = by_key.get((str(e["to_backend"]), key), [])
        if len(found) == 1:
            out[ref.kind].append((float(e["gap_ms"]), found[0]))
    return out


def floor_stats(pairs: Sequence[tuple[float, float]]) -> dict[str, float]:
    return {"n": len(pairs), "engine_ttft_p50": stats.percentile([f for _, f in pairs], 50),
            "baton_p50": stats.percentile([g - f for g, f in pairs], 50)}  # fmt: skip


PLACES = ("content", "calls", "answer")


def place(e: Mapping[str, Any], refs: Mapping[str, Turn]) -> str:
    """Where an agent stream's seam fell: in the content before its calls, in the calls' text
    (more tokens sent than the reference's content), or in a turn that calls nothing."""
    ref = refs.get(str(e.get("request_id")))
    if ref is None or ref.finish != "tool_calls" or ref.call_at is None:
        return "answer"
    return "calls" if int(e.get("tokens_sent", 0)) > ref.call_at else "content"


def pct(ok: int, n: int) -> float:
    return 100 * ok / n if n else stats.NAN


def summarize(
    convs: Mapping[int, Sequence[Turn]], conv_refs: Mapping[int, Sequence[Turn]],
    plains: Mapping[int, Turn], plain_refs: Mapping[int, Turn],
    events: Sequence[Mapping[str, Any]], kills: int,
    engine: Mapping[str, Sequence[tuple[float, float]]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Everything the report prints, from raw records; no I/O. `conv_refs` and `plain_refs`
    are keyed like the runs they judge (a conversation's or plain stream's own reference)."""
    verdicts = {i: judge_conversation(convs.get(i, ()), ref) for i, ref in conv_refs.items()}
    turn_v = [v for vs in verdicts.values() for v in vs]
    plain_v = {i: judge(plains.get(i), ref) for i, ref in plain_refs.items()}
    everything = [*(t for ts in convs.values() for t in ts), *plains.values()]
    kind_of = {t.rid: t for t in everything if t.rid}
    by_kind: dict[str, list[Mapping[str, Any]]] = {"agent": [], "plain": []}
    for e in events:
        t = kind_of.get(str(e.get("request_id")))
        if t is not None:
            by_kind[t.kind].append(e)
    gaps = {k: [float(e["gap_ms"]) for e in es if e.get("outcome") == "resumed"]
            for k, es in by_kind.items()}  # fmt: skip
    p50 = {k: stats.percentile(g, 50) for k, g in gaps.items()}
    p99 = {k: stats.percentile(g, 99) for k, g in gaps.items()}
    refs = {t.rid: conv_refs[t.key][t.turn - 1] for t in everything
            if t.kind == "agent" and t.turn <= len(conv_refs.get(t.key, ()))}  # fmt: skip
    places = Counter(place(e, refs) for e in by_kind["agent"] if e.get("outcome") == "resumed")
    bad = [t for t in everything if t.verdict != "completed"]
    return {
        "conversations": len(conv_refs),
        "agent_turns": len(turn_v),
        "turns_per_conversation": dict(Counter(str(len(r)) for r in conv_refs.values())),
        "calls": sum(len(t.calls) for r in conv_refs.values() for t in r),
        "plain_streams": len(plain_refs),
        "turns_identical_pct": pct(turn_v.count(""), len(turn_v)),
        "conversations_identical_pct": pct(
            sum(1 for vs in verdicts.values() if not any(vs)), len(verdicts)),
        "plain_identical_pct": pct(list(plain_v.values()).count(""), len(plain_v)),
        "errors": len(bad),
        "errors_by_kind": dict(Counter(t.kind for t in bad)),
        "failovers": {k: dict(Counter(str(e.get("outcome")) for e in es))
                      for k, es in by_kind.items()},  # fmt: skip
        "unmatched_failovers": len(events) - sum(len(es) for es in by_kind.values()),
        "agent_resumed_at": {k: {"n": places[k], "gap_ms": stats.p50_p99(
            [float(e["gap_ms"]) for e in by_kind["agent"] if e.get("outcome") == "resumed"
             and place(e, refs) == k])} for k in PLACES},  # fmt: skip
        "gap_ms": {k: {"p50": p50[k], "p99": p99[k], "n": len(gaps[k])} for k in gaps},
        "gap_ratio_p50": p50["agent"] / p50["plain"] if p50["plain"] > 0 else stats.NAN,
        "gap_ratio_p99": p99["agent"] / p99["plain"] if p99["plain"] > 0 else stats.NAN,
        "engine_floor": {k: floor_stats((engine or {}).get(k, ())) for k in ("agent", "plain")},
        "kills": kills,
        "non_identical": [{"conversation": i, "turn": n + 1, "why": v,
                           "rid": convs[i][n].rid if n < len(convs.get(i, ())) else ""}
                          for i, vs in verdicts.items() for n, v in enumerate(vs) if v]
                         + [{"plain": i, "why": v, "rid": plains[i].rid if i in plains else ""}
                            for i, v in plain_v.items() if v],  # fmt: skip
        "bad_streams": [{"kind": t.kind, "key": t.key, "turn": t.turn, "rid": t.rid,
                         "verdict": t.verdict, "status": t.status, "error": t.error,
                         "failovers": [e for e in events if e.get("request_id") == t.rid]}
                        for t in bad],  # fmt: skip
    }


def targets(s: Mapping[str, Any]) -> list[stats.Target]:
    return [
        stats.Target("client-visible errors (failed + truncated streams)", s["errors"], 0),
        stats.Target("agent turns identical %", s["turns_identical_pct"], 100, True),
        stats.Target("agent conversations identical %", s["conversations_identical_pct"], 100,
                     True),  # fmt: skip
        stats.Target("plain chat streams identical %", s["plain_identical_pct"], 100, True),
        stats.Target("failovers of agent streams refused", s["failovers"]["agent"].get(
            "refused", 0), 0),  # fmt: skip
        stats.Target("failovers of agent streams resumed (the run tested a resume)",
                     s["failovers"]["agent"].get("resumed", 0), 1, True),  # fmt: skip
    ]


def report(s: Mapping[str, Any]) -> str:
    def counts(d: Mapping[str, int]) -> str:
        return " ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"

    def p50_99(d: Mapping[str, float]) -> str:
        return f"{stats.fmt(d['p50'])} / {stats.fmt(d['p99'])}"

    def gap(k: str) -> str:
        g = s["gap_ms"][k]
        return f"{stats.fmt(g['p50'])} / {stats.fmt(g['p99'])} (n={g['n']})"

    def floor(key: str) -> str:
        f = s["engine_floor"]
        return " | ".join(f"{stats.fmt(f[k][key])} (n={f[k]['n']})" for k in ("agent", "plain"))

    rows = [
        ["conversations (turns each)", f"{s['conversations']} "
                                       f"({counts(s['turns_per_conversation'])})"],
        ["agent turns / tool calls in them", f"{s['agent_turns']} / {s['calls']}"],
        ["plain chat streams", str(s["plain_streams"])],
        ["agent turns identical", f"{stats.fmt(s['turns_identical_pct'], 1)} %"],
        ["agent conversations identical", f"{stats.fmt(s['conversations_identical_pct'], 1)} %"],
        ["plain chat streams identical", f"{stats.fmt(s['plain_identical_pct'], 1)} %"],
        ["client-visible errors", f"{s['errors']} ({counts(s['errors_by_kind'])})"],
        ["kills performed", str(s["kills"])],
        ["failovers, agent streams", counts(s["failovers"]["agent"])],
        *([f"  resumed in the {k}: n, gap p50 / p99 (ms)",
           f"{s['agent_resumed_at'][k]['n']}, {p50_99(s['agent_resumed_at'][k]['gap_ms'])}"]
          for k in PLACES),
        ["failovers, plain streams", counts(s["failovers"]["plain"])],
        ["gap p50 / p99 (ms), agent", gap("agent")],
        ["gap p50 / p99 (ms), plain chat", gap("plain")],
        ["gap agent / plain, p50 | p99",
         f"{stats.fmt(s['gap_ratio_p50'])} | {stats.fmt(s['gap_ratio_p99'])}"],
        ["new backend's own TTFT p50 (ms), agent | plain", floor("engine_ttft_p50")],
        ["  Baton's share (gap - that TTFT) p50 (ms), agent | plain", floor("baton_p50")],
        ["machine CPU busy during the chaos | 1-min load average",
         f"{stats.fmt(s.get('machine_busy', stats.NAN))} | "
         f"{stats.fmt(s.get('load_avg_1m', stats.NAN), 1)}"],
    ]  # fmt: skip
    table = stats.render_table(("metric", "value"), rows)
    return "\n".join([table, "", *stats.target_lines(targets(s))])
