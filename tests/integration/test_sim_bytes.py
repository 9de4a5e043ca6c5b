"""Byte-level and reasoning sims as real processes: what a client sees over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from clients.procs import Part
from sim.generation import released_text
from sim.tokenizer import build_tokenizer
from tests.integration.harness import MODEL, http, start_sim

BYTES = build_tokenizer(byte_level=True)
MESSAGES = [{"role": "user", "content": "Écris-moi quelque chose, s'il te plaît: 中文 😀"}]
QUESTION = "What does a router do?"


def post(part: Part, path: str, body: dict[str, Any]) -> Any:
    status, raw = http(
        "POST", part.ready + path, json.dumps({"model": MODEL, **body}).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200, raw
    if body.get("stream"):
        return [
            json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: {")
        ]
    return json.loads(raw)


@pytest.fixture(scope="module")
def byte_sim() -> Iterator[Part]:
    p = start_sim("--byte-level")
    yield p
    p.stop(grace=3)


@pytest.fixture(scope="module")
def reasoning_sim() -> Iterator[Part]:
    p = start_sim("--reasoning", "--think-tokens", "12", "--byte-level")
    yield p
    p.stop(grace=3)


def texts(chunks: list[dict[str, Any]], chat: bool) -> list[str]:
    out = []
    for ch in chunks:
        if not ch["choices"]:
            continue
        c = ch["choices"][0]
        out.append(c["delta"].get("content") or "" if chat else c["text"])
    return out


@pytest.mark.parametrize("max_tokens", [37, 64, 200])
def test_byte_level_stream_adds_up_to_the_non_streaming_text(
    byte_sim: Part, max_tokens: int
) -> None:
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    full = post(byte_sim, "/v1/chat/completions", {**body, "return_token_ids": True})
    text = full["choices"][0]["message"]["content"]
    chunks = post(byte_sim, "/v1/chat/completions",
                  {**body, "stream": True, "return_token_ids": True})
    tokens = [c["choices"][0] for c in chunks[1:]]
    assert "".join(texts(chunks, chat=True)) == text
    # One chunk per token, ids always there, text empty while bytes are held.
    ids = [t for c in tokens for t in c["token_ids"]]
    assert ids == full["choices"][0]["token_ids"] and len(tokens) == max_tokens
    assert any(c["delta"]["content"] == "" for c in tokens)
    assert any(not ch.isascii() and ch != "\ufffd" for ch in text)
    # Never half a character in a chunk: held bytes come out with the token that ends them.
    assert not any(c["delta"]["content"].endswith("\ufffd") for c in tokens)


def test_byte_level_completions_stream_matches_and_detokenize_is_a_plain_decode(
    byte_sim: Part,
) -> None:
    body = {"prompt": "Le café est", "max_tokens": 120, "temperature": 0}
    full = post(byte_sim, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
    chunks = post(byte_sim, "/v1/completions", {**body, "stream": True})
    assert "".join(texts(chunks, chat=False)) == full["text"]
    plain = post(byte_sim, "/detokenize", {"tokens": full["token_ids"]})["prompt"]
    assert plain == BYTES.decode(full["token_ids"])  # specials included, U+FFFD for bad bytes
    assert "\ufffd" in plain  # invalid sequences are there in the raw bytes
    cut = post(byte_sim, "/tokenize", {"prompt": "中é", "add_special_tokens": False})["tokens"]
    assert cut == BYTES.encode("中é") != build_tokenizer().encode("中é")  # its own vocabulary


def test_resume_prompt_cut_mid_character_streams_the_prompt_text_first(byte_sim: Part) -> None:
    """The vLLM quirk a router must survive: priming on a prompt that ends inside a
    character makes the first release the whole prompt's text."""
    msgs = [{"role": "user", "content": QUESTION}]
    ref = post(byte_sim, "/v1/chat/completions",
               {"messages": msgs, "max_tokens": 120, "temperature": 0, "return_token_ids": True})
    prompt_ids, gen = ref["prompt_token_ids"], ref["choices"][0]["token_ids"]
    mid = [k for k in range(1, len(gen)) if BYTES.ends_mid_character(prompt_ids + gen[:k])]
    cut = mid[0]
    resume = {"prompt": prompt_ids + gen[:cut], "max_tokens": len(gen) - cut, "temperature": 0,
              "return_token_ids": True}
    chunks = post(byte_sim, "/v1/completions", {**resume, "stream": True})
    got_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert got_ids == gen[cut:]  # the tokens are exact ...
    streamed = "".join(texts(chunks, chat=False))
    # ... but the text starts with the prompt (template specials stripped).
    first = next(t for t in texts(chunks, chat=False) if t)
    assert first.startswith(QUESTION) and streamed.startswith(QUESTION)
    assert streamed == released_text(BYTES, prompt_ids + gen[:cut], gen[cut:])
    # Non-streaming text carries it too.
    text = post(byte_sim, "/v1/completions", resume)["choices"][0]["text"]
    assert text == streamed
    # A cut on a character boundary has no such junk.
    clean = next(k for k in range(1, len(gen)) if k not in mid)
    body = {**resume, "prompt": prompt_ids + gen[:clean], "max_tokens": len(gen) - clean}
    assert QUESTION not in post(byte_sim, "/v1/completions", body)["choices"][0]["text"]


def test_text_path_reencodes_replacement_characters_as_bytes(byte_sim: Part) -> None:
    ids = post(byte_sim, "/tokenize", {"prompt": "a\ufffdb", "add_special_tokens": False})
    assert ids["tokens"] == [97, 0xEF, 0xBF, 0xBD, 98]


# -- reasoning ---------------------------------------------------------------------------
def _deltas(chunks: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int] | None]]:
    return [(c["choices"][0]["delta"], c["choices"][0].get("token_ids")) for c in chunks[1:]]


def test_reasoning_stream_splits_reasoning_from_content(reasoning_sim: Part) -> None:
    tok = build_tokenizer(byte_level=True, reasoning=True)
    end = tok.encode("</think>")[0]
    body = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0}
    full = post(reasoning_sim, "/v1/chat/completions", {**body, "return_token_ids": True})
    assert full["prompt_token_ids"][-1] == tok.encode("<think>")[0]
    msg, gen = full["choices"][0]["message"], full["choices"][0]["token_ids"]
    j = gen.index(end)
    assert j >= 12 and msg["reasoning"] and msg["content"]
    with_ids = post(reasoning_sim, "/v1/chat/completions",
                    {**body, "stream": True, "return_token_ids": True})
    deltas = _deltas(with_ids)
    assert with_ids[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [ids for _, ids in deltas] == [[t] for t in gen]  # every id, one per chunk
    assert deltas[j] == ({}, [end])  # the lone </think> chunk: empty delta
    assert all(set(d) == {"reasoning"} for d, _ in deltas[:j])
    assert all(set(d) == {"content"} for d, _ in deltas[j + 1 :])
    assert "".join(d["reasoning"] for d, _ in deltas[:j]) == msg["reasoning"]
    assert "".join(d["content"] for d, _ in deltas[j + 1 :]) == msg["content"]
    # Without token ids, vLLM skips the chunk of the lone </think>.
    plain = _deltas(post(reasoning_sim, "/v1/chat/completions", {**body, "stream": True}))
    assert [d for d, _ in plain] == [d for d, _ in deltas[:j] + deltas[j + 1 :]]


def test_reasoning_ends_in_the_think_block_and_completions_run_no_parser(
    reasoning_sim: Part,
) -> None:
    body = {"messages": MESSAGES, "temperature": 0}
    short = post(reasoning_sim, "/v1/chat/completions", {**body, "max_tokens": 5})
    msg = short["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning"]  # no </think> yet: all reasoning
    hidden = post(reasoning_sim, "/v1/chat/completions",
                  {**body, "max_tokens": 80, "include_reasoning": False})
    assert hidden["choices"][0]["message"]["reasoning"] is None
    assert hidden["choices"][0]["message"]["content"]
    tokens = post(reasoning_sim, "/tokenize", {"messages": MESSAGES})["tokens"]
    raw = post(reasoning_sim, "/v1/completions", {"prompt": tokens, "max_tokens": 80,
                                                   "temperature": 0})
    full = post(reasoning_sim, "/v1/chat/completions", {**body, "max_tokens": 80})
    m = full["choices"][0]["message"]
    assert raw["choices"][0]["text"] == m["reasoning"] + "</think>" + m["content"]
