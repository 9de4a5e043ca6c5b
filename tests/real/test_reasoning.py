"""Baton in front of vLLM running `--reasoning-parser deepseek_r1` on tiny-think, a model
whose chat template opens <think> and whose greedy output closes it with </think> (a
non-special added token) ~500 tokens in, then goes on with content.

vLLM's parser splits a chat stream into `reasoning` deltas, then `content` deltas (the
chunk whose only token is </think> carries no text). A token-path resume runs on
/v1/completions, which runs no parser and streams the raw text, "</think>" included: the
client must still get the reasoning and the content, each byte-identical to an
uninterrupted stream, when the replica is SIGKILLed while the model is still reasoning.

Run: .venv/bin/pytest -m real tests/real/test_reasoning.py"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.real.conftest import Pool, baton
from tests.real.streams import Case, direct, failovers, kill_round

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

MODEL = "tiny-think"
THINK_END = 264  # the </think> token's id in tiny-think's vocabulary
TOKENS = 900  # </think> comes ~480-500 tokens in, then content
CASES = [Case("chat", "hi"), Case("chat", "tell me a story")]
ROUNDS = 3  # kill rounds at most: more only while no kill has landed inside the reasoning


def test_vllm_reasoning_killed_while_reasoning(pool: Pool, tmp_path: Path) -> None:
    engines = pool.get("t0", "t1")
    refs = {c: direct(engines[1], c, TOKENS) for c in CASES}
    think_at: dict[Case, int] = {}
    for case, ref in refs.items():
        # The model and parser do what the test is about (or it proves nothing).
        assert set(ref.texts) == {"reasoning", "content"}, (case, list(ref.texts))
        assert ref.ids.count(THINK_END) == 1, case
        assert "</think>" not in ref.text, case
        think_at[case] = ref.ids.index(THINK_END)
        assert 100 < think_at[case] < TOKENS - 100, (case, think_at[case])
        assert direct(engines[0], case, TOKENS).texts == ref.texts, "the replicas disagree"
    inside: list[dict[str, Any]] = []  # failovers whose resume began inside the reasoning
    for n in range(ROUNDS):
        if inside:
            break
        engines = pool.get("t0", "t1")
        with baton(tmp_path / f"round{n}", engines) as fleet:
            r = kill_round(pool, fleet, MODEL, CASES, TOKENS, vllm=True)
            evs = failovers(fleet, r)
        if r.victim:
            pool.revive(r.victim)
        for s in r.streams:
            ref = refs[s.case]
            ev = evs.get(s.request_id)
            where = f"{s.case} (failover {ev})"
            assert not s.error, f"{where}: {s.error}"
            assert s.texts.get("reasoning") == ref.texts["reasoning"], f"{where}: reasoning"
            assert s.texts.get("content") == ref.texts["content"], f"{where}: content"
            assert s.texts.keys() == ref.texts.keys(), f"{where}: {list(s.texts)}"
            assert s.finish == "length", where
            assert len(s.stream_ids) == 1, f"{where}: the client must see one stream id"
            assert s.completion_tokens == TOKENS, where
            if ev is None:
                continue
            assert (ev["from_backend"], ev["outcome"]) == (r.victim, "resumed"), ev
            assert ev["path"] == "token" and ev["seam"] == "verified", ev
            print(
                f"round {n}: {s.case} resumed after {ev['tokens_sent']} tokens "
                f"(</think> is token {think_at[s.case]})"
            )
            if ev["tokens_sent"] <= think_at[s.case]:
                inside.append(ev)
    assert inside, f"no kill in {ROUNDS} rounds landed while the model was still reasoning"
