"""Baton in front of real engines serving tiny-bytes, a byte-level model whose greedy output
mixes ASCII, multi-byte characters split one byte per token, and invalid UTF-8 (U+FFFD once
decoded), like a real byte-level BPE model (Llama 3, Qwen).

vLLM holds an incomplete character back while streaming (the chunk carries the token id and
no text), and an engine primed with a prompt that ends mid-character (prompt ids +
generated ids, the token-path resume) sends the text of the WHOLE prompt in its first chunk
(docs/real-engine-bytes.md). The token path must hide both: every stream a kill landed in
is byte-identical to an uninterrupted one. llama-server gets the text path, which cannot
carry bytes that are not UTF-8: there the seam verdict must say so.

Run: .venv/bin/pytest -m real tests/real/test_bytes.py"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dataplane.settings import ResumeSettings
from scripts.engines.replicas import Engine
from tests.real.conftest import Pool, baton, sdk
from tests.real.streams import (
    REPLACEMENT,
    Case,
    KillWhen,
    Streamed,
    decode,
    direct,
    directs,
    failed_over,
    failover_event,
    failovers,
    kill_round,
    mid_character,
    released,
)

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

MODEL = "tiny-bytes"
TOKENS = 1000  # per vLLM stream; vLLM runs far ahead of the client, the kill comes early
LLAMA_TOKENS = 3000  # llama-server makes ~2,000 tokens/s of this model
CASES = [
    Case("chat", "hi", stream_interval=20),
    Case("chat", "tell me a story"),
    Case("chat", "what is a router?"),
    Case("completions", "The router said: "),
    Case("completions", "Once upon a time"),
    Case("completions", "def main():", stream_interval=20),
]
# Two cases come 20 tokens per chunk (vLLM's stream_interval), as a loaded vLLM also merges
# them: such chunks tell no character boundary, and a seam there must still be verified.
SEAM_TOKENS = ResumeSettings().seam_tokens  # the shims' default m
ROUNDS = 3  # kill rounds at most: more only while no kill has landed mid-character


def references(engines: list[Engine], cases: list[Case], tokens: int) -> dict[Case, Streamed]:
    """Uninterrupted direct streams, the cases split over both replicas (which must agree:
    the first case is run on both)."""
    jobs = [(engines[i % len(engines)], c) for i, c in enumerate(cases)]
    *streams, again = directs([*jobs, (engines[1], cases[0])], tokens)
    refs = dict(zip(cases, streams, strict=True))
    assert again.text == refs[cases[0]].text, "the replicas disagree: settings differ"
    return refs


def mid_character_kill(refs: dict[Case, Streamed]) -> KillWhen:
    """Kill once a stream the victim serves stands mid-character, as the client has it (its
    token ids) with the engine frozen: then the resume is primed mid-character. Where a
    stream stands after a given number of chunks depends on how fast the engine runs ahead
    of the client (in CI a fifth chunk came 181 tokens in, past every character)."""

    def ready(streams: Sequence[Streamed], on_victim: Sequence[bool]) -> bool:
        return any(
            v and not s.finish and len(s.ids) > SEAM_TOKENS
            and mid_character(refs[s.case], len(s.ids))
            for s, v in zip(streams, on_victim, strict=True)
        )  # fmt: skip

    return ready


def assert_byte_model(refs: dict[Case, Streamed]) -> None:
    """The model really emits what the test is about (or the test proves nothing)."""
    for ref in refs.values():
        text = ref.text
        assert REPLACEMENT in text, f"{ref.case}: no invalid UTF-8 in the output"
        assert any(ord(c) > 127 and c != REPLACEMENT for c in text), f"{ref.case}: no multi-byte"
        assert any(ord(c) < 128 for c in text), f"{ref.case}: no ASCII"
        assert len(ref.ids) == TOKENS
        assert text == released(ref.ids), f"{ref.case}: vLLM's text is not its ids' bytes"


# -- what vLLM does (no Baton): the facts the token path must hide ----------------------


def test_vllm_primed_mid_character_sends_the_prompt_text(pool: Pool) -> None:
    """A /v1/completions prompt of ids that ends mid-character: vLLM's first text chunk is
    the whole prompt's text (specials skipped) plus the continuation; cut at a character
    boundary, only the continuation comes. If this starts failing, vLLM changed, and the
    token path's defence against it may no longer be needed (or be wrong)."""
    engine, _ = pool.get("b0", "b1")  # both: the next test needs them, and they start at once
    c = sdk(engine.url + "/v1")
    chat = direct(engine, CASES[0], 40)
    prompt_ids = [256, 260, *b"hi", 262, 261]  # <|bos|><|user|>hi<|end|><|assistant|>
    cut = next(k for k in range(1, len(chat.ids)) if 0xC2 <= chat.ids[k - 1] <= 0xF4)
    whole = next(k for k in range(1, len(chat.ids)) if not mid_character(chat, k))

    def resumed(k: int) -> list[str]:
        stream = c.completions.create(
            model=MODEL, prompt=prompt_ids + chat.ids[:k], max_tokens=8, temperature=0, stream=True
        )
        return [ch.text for chunk in stream for ch in chunk.choices]

    texts = resumed(cut)
    first = next(t for t in texts if t)
    assert first.startswith("hi"), (cut, chat.ids[:cut], texts)
    assert "".join(texts) == "hi" + released(chat.ids[: cut + 8]), (cut, chat.ids, texts)
    texts = resumed(whole)
    sent = decode(chat.ids[:whole])
    assert "".join(texts) == released(chat.ids[: whole + 8])[len(sent) :], (whole, texts)


# -- vLLM pair: token path --------------------------------------------------------------


def test_vllm_bytes_killed_mid_stream_token_path(pool: Pool, tmp_path: Path) -> None:
    """Six concurrent streams (3 chat, 3 completions) over two vLLM replicas; the replica
    serving the first is SIGKILLed once a stream it serves is mid-character (judged with the
    engine frozen), in each of up to ROUNDS rounds.
    Every stream is judged (byte-identical text, one stream, finish, usage); every one the
    kill landed in also by its failover event (token path, verified seam)."""
    engines = pool.get("b0", "b1")
    refs = references(engines, CASES, TOKENS)
    assert_byte_model(refs)
    landed: list[tuple[Case, dict[str, Any]]] = []
    for n in range(ROUNDS):
        if n and any(mid_character(refs[case], ev["tokens_sent"]) for case, ev in landed):
            break
        engines = pool.get("b0", "b1")
        with baton(tmp_path / f"round{n}", engines) as fleet:
            r = kill_round(pool, fleet, MODEL, CASES, TOKENS,
                           extra_body={"return_token_ids": True},
                           kill_when=mid_character_kill(refs), freeze=True)  # fmt: skip
            evs = failovers(fleet, r)
        if r.victim:
            pool.revive(r.victim)
        for s in r.streams:
            ref = refs[s.case]
            assert not s.error, f"{s.case}: {s.error}"
            ev = evs.get(s.request_id)
            where = f"{s.case} (failover {ev})"
            assert s.text == ref.text, f"{where}: the stream differs from an uninterrupted run"
            assert s.texts.keys() == ref.texts.keys(), where
            assert s.ids == ref.ids, f"{where}: other token ids"
            assert s.finish == "length", where
            assert len(s.stream_ids) == 1, f"{where}: the client must see one stream id"
            assert s.completion_tokens == TOKENS, where
            if ev is None:
                continue
            assert (ev["from_backend"], ev["outcome"]) == (r.victim, "resumed"), ev
            assert ev["to_backend"] != r.victim, ev
            n_sent = ev["tokens_sent"]
            # The seam is checked by regenerating the last m tokens the client has: a stream
            # cut before it had more (a first chunk of 20 merged ids is one) has none to check.
            seam = "verified" if n_sent > SEAM_TOKENS else "unchecked"
            assert (ev["path"], ev["seam"]) == ("token", seam), (
                f"{s.case}: {n_sent} tokens sent, {ev['path']} path, seam {ev['seam']}: {ev}"
            )
            landed.append((s.case, ev))
            print(
                f"round {n}: {s.case} resumed after {n_sent} tokens, last ids "
                f"{ref.ids[max(0, n_sent - 3) : n_sent]}, mid-character: "
                f"{mid_character(ref, n_sent)}"
            )
    assert landed, "no kill landed while the engine was generating"
    sent = [ev["tokens_sent"] for _, ev in landed]
    assert any(mid_character(refs[case], ev["tokens_sent"]) for case, ev in landed), (
        f"no kill in {ROUNDS} rounds landed mid-character (tokens sent: {sent})"
    )


# -- llama-server trio: text path, honest seam verdict ----------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_llama_bytes_killed_mid_stream_seam_is_honest(
    pool: Pool, tmp_path: Path, endpoint: str
) -> None:
    """llama-server replicas on tiny-bytes.gguf (Baton kind openai: the text path). A text
    resume re-tokenizes the client's text, and U+FFFD is not the bytes the model emitted:
    the resumed stream may differ from an uninterrupted one. Then the failover event must
    not claim a verified seam."""
    engines = pool.get("lb0", "lb1", "lb2")
    cases = [c for c in CASES if c.endpoint == endpoint]
    wants = {
        c: direct(engines[i % len(engines)], c, LLAMA_TOKENS).text for i, c in enumerate(cases)
    }
    outcomes: list[str] = []
    for i, case in enumerate(cases):
        want = wants[case]
        assert REPLACEMENT in want, f"{case}: no invalid UTF-8 in the output"
        for attempt in range(3):
            engines = pool.get("lb0", "lb1", "lb2")  # the one killed last is back (0.1 s)
            with baton(tmp_path / f"s{i}-{attempt}", engines) as fleet:
                r = kill_round(pool, fleet, MODEL, [case], LLAMA_TOKENS)
                (got,) = r.streams
                ev = (
                    failover_event(fleet, got.request_id)
                    if failed_over(fleet, got.request_id, timeout=5)
                    else None
                )
            assert not got.error, f"{case}: {got.error}"
            assert len(got.stream_ids) == 1 and got.finish == "length", case
            if ev is not None:
                break
            # No failover: the engine had sent everything before the kill landed.
            assert got.text == want, f"{case}: no failover, yet the text differs"
        assert ev is not None, f"{case}: the engine finished every stream before the kill"
        assert ev["from_backend"] == r.victim and ev["to_backend"] != r.victim, ev
        assert ev["path"] == "text" and ev["outcome"] == "resumed", ev
        identical = got.text == want
        if not identical:
            assert ev["seam"] in ("divergent", "unchecked"), (
                f"{case}: the client's text differs from an uninterrupted run, yet the seam "
                f"is {ev['seam']!r}: {ev}"
            )
        outcomes.append(f"{case}: identical={identical} seam={ev['seam']}")
    print("\n".join(outcomes))
