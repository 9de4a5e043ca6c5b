"""Baton in front of vLLM running `--reasoning-parser deepseek_r1` on the two kinds of think
tokenizer: tiny-think, whose <think>/</think> are ordinary added tokens (DeepSeek-R1, Qwen3:
a stream shows their text), and tiny-think-special, the same model with the tags special
tokens (skip_special_tokens, vLLM's default, drops their text; the parser still goes by
their ids). The chat template opens <think>; the weights close it with </think> at one
fixed position of the sequence, so a longer prompt brings it sooner: each case's prompt
puts the end of thinking a few tokens further into the reply, and one SIGKILL of the
replica serving them lands before the end tag for some streams, on or next to it for
others (the seam overlap then regenerates it), after it for the rest. Chunks of one token
and chunks of several (stream_interval) both.

Every stream is judged, whatever its kill landed on: its reasoning and its content must be
the split by ids (the text of the tokens before </think> is reasoning, after it content: an
uninterrupted one-token stream's), also where the engine merged </think> into a chunk with
other tokens: there vLLM's own parser cuts a special tag's chunk at text.find(tag) == -1
(as_vllm_sends, checked on the direct streams), and Baton splits that chunk by ids instead.
The client asks for token ids (the tiny models' text is one byte per id, so a chunk's text
is known from them).

Run: .venv/bin/pytest -m real tests/real/test_reasoning.py"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.real.conftest import Pool, baton
from tests.real.streams import Case, Streamed, decode, direct, directs, failovers, kill_round

pytestmark = [pytest.mark.real, pytest.mark.timeout(1200)]

THINK_END = 264  # the </think> token's id in both tiny-think vocabularies
TAG = "</think>"
SEAM = 4  # the shim's seam overlap (tokens): a kill this close after the tag regenerates it
# Where each case's </think> comes among the generated tokens, and its chunking. Where a
# replica's streams stand when it is killed depends on how vLLM admits and batches them and
# on the machine (1 to 125 tokens in, seen here and in CI), so the kill waits on the
# streams' state (kill_when) and the tags spread over the whole range.
PLACES = [(t, interval) for t in range(5, 90, 2) for interval in (None, 3)]
AFTER = 40  # tokens of content after the latest tag
ROUNDS = 6  # kill rounds at most: more only while some landing has not been seen
# How far the client's count of a stream's tokens may trail what the shim had sent when the
# engine died (chunks in flight): a kill meant to land "on" waits for a stream at most this
# far past its tag, so that what the shim sent is within SEAM of it.
LAG = SEAM - 2


def truth(ids: Sequence[int]) -> dict[str, str]:
    """An uninterrupted stream's split, by ids: before </think> reasoning, after it content."""
    end = ids.index(THINK_END)
    out = {"reasoning": decode(ids[:end]), "content": decode(ids[end + 1 :])}
    return {k: v for k, v in out.items() if v}


def as_vllm_sends(s: Streamed, special: bool, sent: int | None) -> dict[str, str]:
    """The reasoning and content vLLM's parser gives the chunks the client got. `sent`: the
    tokens of the first (engine) stream before Baton resumed (None: no failover); a chunk
    of Baton's resume is split by ids."""
    out = {"reasoning": "", "content": ""}
    at, thinking = 0, True
    for ids, _ in s.chunks:
        start, at = at, at + len(ids)
        if THINK_END not in ids:
            out["reasoning" if thinking else "content"] += decode(ids)
            continue
        thinking = False
        if len(ids) == 1:
            continue  # the tag alone: no text
        j = ids.index(THINK_END)
        before, after = decode(ids[:j]), decode(ids[j + 1 :])
        from_engine = sent is None or start + j < sent
        if special and from_engine:
            text = before + after  # find() == -1: reasoning text[:-1], content text[7:]
            before, after = text[:-1], text[len(TAG) - 1 :]
        out["reasoning"] += before
        out["content"] += after
    return {k: v for k, v in out.items() if v}


def label(case: Case) -> str:
    merged = f", {case.stream_interval} per chunk" if case.stream_interval else ""
    return f"chat ({len(case.prompt)}-character prompt{merged})"


def landing(sent: int, think_at: int) -> str:
    if sent <= think_at:
        return "before" if sent < think_at else "just before"
    return "on" if sent <= think_at + SEAM else "after"


def kill_when(
    think_at: dict[Case, int], seen: set[tuple[str, bool]]
) -> Callable[[Sequence[Streamed], Sequence[bool]], bool]:
    """When to kill: once the victim's streams, as the client has them, hold a stream for
    each landing not seen yet, one of them of each chunking not seen yet. A stream counts
    as "on" from one token past its tag to LAG past it (the shim may have sent up to LAG
    more), "before" while the shim cannot have reached its tag, "after" once the client
    itself is past the overlap."""
    want = {"before", "on", "after"} - {w for w, _ in seen}
    kinds = {False, True} - {m for _, m in seen}
    want = want or {"on"}  # every landing seen (merged or not missing): aim at the tag

    def where(s: Streamed) -> str:
        d = len(s.ids) - think_at[s.case]
        if d <= -LAG - 1:
            return "before"
        if 1 <= d <= LAG:
            return "on"
        return "after" if d > SEAM else ""

    def ready(streams: Sequence[Streamed], on_victim: Sequence[bool]) -> bool:
        now = {(where(s), s.case.stream_interval is not None)
               for s, v in zip(streams, on_victim, strict=True) if v and not s.finish}  # fmt: skip
        if not want <= {w for w, _ in now}:
            return False
        return not kinds or any(m in kinds for w, m in now if w in want)

    return ready


@pytest.mark.parametrize(
    "prefix,model,special", [("t", "tiny-think", False), ("s", "tiny-think-special", True)]
)
def test_vllm_reasoning_killed_before_on_and_after_the_end_tag(
    pool: Pool, tmp_path: Path, prefix: str, model: str, special: bool
) -> None:
    names = (f"{prefix}0", f"{prefix}1")
    engines = pool.get(*names)
    # "hi" puts </think> ~495 tokens in; each more character of prompt brings it one sooner.
    base = direct(engines[1], Case("chat", "hi"), 600).ids.index(THINK_END)
    cases = [Case("chat", "x" * (base - t + 2), interval) for t, interval in PLACES]
    tokens = PLACES[-1][0] + AFTER
    refs = dict(zip(cases, directs([(engines[1], c) for c in cases], tokens), strict=True))
    others = directs([(engines[0], c) for c in cases], tokens)
    think_at: dict[Case, int] = {}
    for (case, ref), other in zip(refs.items(), others, strict=True):
        # The model and parser do what the test is about (or it proves nothing).
        assert ref.ids.count(THINK_END) == 1, case
        think_at[case] = ref.ids.index(THINK_END)
        assert TAG not in ref.text, case  # the parser takes the tag out of both fields
        # What vLLM's parser makes of the chunks it sent: the split by ids where the tag came
        # alone, its own cut where the engine merged it with other tokens (a loaded engine
        # merges them even unasked: seen here with stream_interval unset).
        assert ref.texts == as_vllm_sends(ref, special, None), case
        if all(len(ids) == 1 for ids, _ in ref.chunks if THINK_END in ids):
            assert ref.texts == truth(ref.ids), case  # the switch in place
        assert other.ids == ref.ids, "the replicas disagree"
    assert sorted(think_at.values()) == sorted(t for t, _ in PLACES), think_at
    seen: set[tuple[str, bool]] = set()  # (landing, merged) of every judged failover
    for n in range(ROUNDS):
        if {w for w, _ in seen} >= {"before", "on", "after"} and {m for _, m in seen} == {
            False, True,
        }:  # fmt: skip
            break
        engines = pool.get(*names)
        # Shuffled: the order vLLM admits streams in must not follow where their tags are.
        order = random.Random(n).sample(cases, len(cases))
        with baton(tmp_path / f"round{n}", engines) as fleet:
            r = kill_round(pool, fleet, model, order, tokens,
                           extra_body={"return_token_ids": True},
                           kill_when=kill_when(think_at, seen))  # fmt: skip
            evs = failovers(fleet, r)
        if r.victim:
            pool.revive(r.victim)
        for s in r.streams:
            ev: dict[str, Any] | None = evs.get(s.request_id)
            where = f"{label(s.case)} (</think> at {think_at[s.case]}; failover {ev})"
            assert not s.error, f"{where}: {s.error}"
            assert s.ids == refs[s.case].ids, f"{where}: other tokens"
            near = [c for i, c in enumerate(s.chunks) if any(THINK_END in x[0] for x in
                    s.chunks[max(0, i - 1) : i + 2])]  # fmt: skip
            # Through Baton the split is by ids, chunks merged or not (Baton splits a chunk
            # vLLM's parser mis-split itself).
            assert s.texts == truth(s.ids), f"{where}: chunks {near}"
            assert s.finish == "length" and s.completion_tokens == tokens, where
            assert len(s.stream_ids) == 1, f"{where}: the client must see one stream id"
            if ev is None:
                continue
            assert (ev["from_backend"], ev["outcome"]) == (r.victim, "resumed"), ev
            # Verified; unchecked only when too little was sent for an overlap of SEAM tokens.
            few = int(ev["tokens_sent"]) <= SEAM
            assert ev["path"] == "token", ev
            assert ev["seam"] == "verified" or (few and ev["seam"] == "unchecked"), ev
            where_kill = landing(int(ev["tokens_sent"]), think_at[s.case])
            seen.add((where_kill, s.case.stream_interval is not None))
            print(f"round {n}: {label(s.case)} resumed after {ev['tokens_sent']} tokens, "
                  f"</think> is token {think_at[s.case]}: {where_kill}")  # fmt: skip
    landed = {w for w, _ in seen}
    assert landed >= {"before", "on", "after"}, f"in {ROUNDS} rounds the kills landed {seen}"
    assert {m for _, m in seen} == {False, True}, f"merged and one-token chunks: {seen}"
