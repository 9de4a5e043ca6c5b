"""Sampled-token logprobs in vLLM 0.32's shapes (sim.logprobs) and POST /inference/v1/generate
(sim.generate_http): field for field on one-token and merged chunks, the same greedy tokens
and logprobs from chat, completions and generate, split characters on a byte-level sim, the
prefix property a token-exact resume relies on, and a cross-check against vLLM's own code."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from sim.logprobs import ChoiceLogprobs, decoded_token
from sim.model import ModelConfig, ToyModel
from sim.server import start_server
from sim.tokenizer import EOS, build_tokenizer
from tests.engines_cache import model_built, vllm_installed
from tests.factories import sim_config

MSGS = [{"role": "user", "content": "Écris 中文 😀, then the stream"}]
BASE = ("--instant", "--enable-scale-out", "--default-max-tokens", "40")
LP = -0.25248244404792786  # rank 1's logprob as float32 (the toy: -log(sum of e^-1.5r))


def post(argv: tuple[str, ...], path: str, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> tuple[int, list[Any]]:  # fmt: skip
    """Status and the JSON body (non-streaming) or every SSE event (streaming)."""

    async def go() -> tuple[int, bytes]:
        runner, port = await start_server(sim_config(*argv), port=0)
        try:
            async with aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{port}{path}"
                async with s.post(url, json=body, headers=headers or {}) as r:
                    return r.status, await r.read()
        finally:
            await runner.cleanup()

    status, raw = asyncio.run(go())
    if not body.get("stream") or status != 200:
        return status, [orjson.loads(raw)]
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return status, [orjson.loads(e) for e in events[:-1]]


def prompt_ids(argv: tuple[str, ...]) -> list[int]:
    _, (body,) = post(argv, "/tokenize", {"messages": MSGS})
    ids: list[int] = body["tokens"]
    return ids


def chat(argv: tuple[str, ...], **kw: Any) -> list[Any]:
    body = {"messages": MSGS, "stream": True, "logprobs": True, "top_logprobs": 3, **kw}
    status, events = post(argv, "/v1/chat/completions", body)
    assert status == 200
    return events


def generate(argv: tuple[str, ...], ids: list[int], **kw: Any) -> list[Any]:
    sp = {"temperature": 0, "max_tokens": 40, "logprobs": 3, **kw.pop("sampling", {})}
    body = {"token_ids": ids, "sampling_params": sp, "output_mode": "text", "stream": True, **kw}
    status, events = post(argv, "/inference/v1/generate", body)
    assert status == 200, events
    return events


def content(events: list[Any]) -> list[Any]:
    return [e for ev in events for c in ev["choices"] if c["logprobs"]
            for e in c["logprobs"]["content"]]  # fmt: skip


# -- shapes ------------------------------------------------------------------------------
def test_chat_chunk_shape() -> None:
    events = chat(BASE, max_tokens=2)
    first = events[1]["choices"][0]
    assert list(first) == ["index", "delta", "logprobs", "finish_reason"]
    (entry,) = first["logprobs"]["content"]
    assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
    assert entry["token"] == first["delta"]["content"] and entry["logprob"] == LP
    assert entry["bytes"] == list(entry["token"].encode())
    tops = entry["top_logprobs"]
    assert len(tops) == 3 and tops[0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
    assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk
    assert chat(BASE, max_tokens=2, top_logprobs=0)[1]["choices"][0]["logprobs"]["content"][0][
        "top_logprobs"] == []  # fmt: skip


def test_completions_chunk_shape_and_offsets() -> None:
    body = {"prompt": "The model", "max_tokens": 6, "stream": True, "logprobs": 2}
    _, events = post(BASE, "/v1/completions", body)
    offset = 0
    for ev in events:
        (choice,) = ev["choices"]
        lp = choice["logprobs"]
        assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
        assert lp["text_offset"] == [offset] and lp["tokens"] == [choice["text"]]
        assert lp["token_logprobs"] == [LP]
        (top,) = lp["top_logprobs"]
        assert list(top)[0] == choice["text"] and len(top) <= 3  # k + 1, equal keys merge
        offset += len(choice["text"])
    _, (full,) = post(BASE, "/v1/completions", {**body, "stream": False})
    lp = full["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == full["choices"][0]["text"]
    assert lp["text_offset"][-1] == offset - len(lp["tokens"][-1])


def test_merged_chunks_cover_all_their_tokens() -> None:
    one = chat(BASE, max_tokens=9)
    merged = chat((*BASE, "--stream-interval", "4"), max_tokens=9)
    assert [len(e["choices"][0]["logprobs"]["content"]) for e in merged[1:]] == [1, 4, 4]
    assert content(merged) == content(one)
    ids = prompt_ids(BASE)
    gen = generate(BASE, ids, sampling={"max_tokens": 9, "stream_interval": 4})
    for ev in gen:
        (c,) = ev["choices"]
        assert len(c["logprobs"]["content"]) == len(c["token_ids"])
    assert content(gen) == content(one)


def test_generate_stream_shapes() -> None:
    ids = prompt_ids(BASE)
    events = generate(BASE, ids, return_token_ids=True, sampling={"max_tokens": 3},
                      stream_options={"include_usage": True})  # fmt: skip
    first, second, last, usage = events
    assert list(first) == ["request_id", "usage", "prompt_token_ids", "output_mode", "choices"]
    assert first["prompt_token_ids"] == ids and "prompt_token_ids" not in second
    assert first["request_id"].startswith("generate-tokens-") and first["usage"] is None
    (c,) = first["choices"]
    assert list(c) == ["index", "finish_reason", "stop_reason", "token_ids", "routed_experts",
                       "sampling_mask", "weight_versions", "text", "logprobs"]  # fmt: skip
    assert len(c["logprobs"]["content"][0]["top_logprobs"]) == 3
    assert last["choices"][0]["finish_reason"] == "length"
    assert usage == {"request_id": first["request_id"], "output_mode": "text", "choices": [],
                     "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + 3,
                               "completion_tokens": 3}}  # fmt: skip
    sp = {"temperature": 0, "max_tokens": 3, "logprobs": 0}
    body = {"token_ids": ids, "sampling_params": sp, "stream": True}
    _, toks = post(BASE, "/inference/v1/generate", body, {"X-Request-Id": "abc"})
    (c,) = toks[0]["choices"]
    assert toks[0]["request_id"] == "generate-tokens-abc" and toks[0]["output_mode"] == "tokens"
    assert "text" not in c and c["logprobs"]["content"] == [{
        "token_id": c["token_ids"][0], "logprob": LP, "rank": 1,
        "top_logprobs": [{"token_id": c["token_ids"][0], "logprob": LP, "rank": 1}],
    }]  # fmt: skip  (logprobs 0 still lists the sampled token in generate)


def test_generate_non_streamed_and_errors() -> None:
    ids = prompt_ids(BASE)
    sp = {"temperature": 0, "max_tokens": 5, "logprobs": 1, "stop_token_ids": []}
    _, (body,) = post(BASE, "/inference/v1/generate",
                      {"token_ids": ids, "sampling_params": sp, "output_mode": "text"})
    (c,) = body["choices"]
    assert body["usage"]["completion_tokens"] == 5 and body["prompt_token_ids"] is None
    assert len(c["logprobs"]["content"]) == 5 and c["finish_reason"] == "length"
    stream = generate(BASE, ids, sampling={"max_tokens": 5, "logprobs": 1})
    assert c["text"] == "".join(e["choices"][0]["text"] for e in stream)
    assert c["logprobs"]["content"] == content(stream)
    stop = {**sp, "stop_token_ids": [c["token_ids"][2]]}
    _, (cut,) = post(BASE, "/inference/v1/generate", {"token_ids": ids, "sampling_params": stop,
                                                      "output_mode": "text"})  # fmt: skip
    (s,) = cut["choices"]
    assert s["token_ids"] == c["token_ids"][:3] and s["stop_reason"] == c["token_ids"][2]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"token_ids": [], "sampling_params": {}}, "token_ids"),
           ({"token_ids": [10**6], "sampling_params": {}}, "out of vocabulary"),
           ({"token_ids": ids}, "sampling_params"),
           ({"token_ids": ids, "sampling_params": {"logprobs": 21}}, "max allowed: 20"),
           ({"token_ids": ids, "sampling_params": {"temperature": 0, "n": 2}}, "greedy"),
           ({"token_ids": ids, "sampling_params": {"detokenize": False}, "output_mode": "text"},
            "detokenize")]  # fmt: skip
    for req, fragment in bad:
        status, (err,) = post(BASE, "/inference/v1/generate", req)
        assert status == 400 and fragment in err["error"]["message"], (req, err)
    status, (err,) = post(BASE[:1], "/inference/v1/generate", {"token_ids": ids})
    assert status == 403 and err["error"]["type"] == "PermissionDeniedError"


# -- one generation, three endpoints ----------------------------------------------------
@pytest.mark.parametrize("argv", [BASE, (*BASE, "--byte-level")])
def test_same_greedy_tokens_and_logprobs_everywhere(argv: tuple[str, ...]) -> None:
    ids = prompt_ids(argv)
    c = chat(argv, return_token_ids=True)
    c_ids = [t for e in c[1:] for t in e["choices"][0]["token_ids"]]
    body = {"prompt": ids, "max_tokens": 40, "stream": True, "logprobs": 3,
            "return_token_ids": True}  # fmt: skip
    _, comp = post(argv, "/v1/completions", body)
    assert [t for e in comp for t in e["choices"][0]["token_ids"]] == c_ids
    lp = [e["choices"][0]["logprobs"] for e in comp]
    assert [t for x in lp for t in x["tokens"]] == [e["token"] for e in content(c)]
    assert [t for x in lp for t in x["token_logprobs"]] == [e["logprob"] for e in content(c)]
    g = generate(argv, ids)
    assert [t for e in g for t in e["choices"][0]["token_ids"]] == c_ids
    assert content(g) == content(c)
    assert "".join(e["choices"][0]["text"] for e in g) == "".join(
        e["choices"][0]["delta"].get("content", "") for e in c)


# -- split characters -----------------------------------------------------------------------
def test_byte_level_split_characters_decode_as_vllm_corrects_them() -> None:
    tok = build_tokenizer(byte_level=True)
    zhong = list("中".encode())  # E4 B8 AD, one byte token each
    assert decoded_token(tok, zhong[0], [ord("a")]) == ""  # incomplete: nothing yet
    assert decoded_token(tok, zhong[1], [ord("a"), zhong[0]]) == ""
    assert decoded_token(tok, zhong[2], [ord("a"), *zhong[:2]]) == "中"  # the whole character
    assert decoded_token(tok, zhong[2], []) == ""  # no sampled context: the prompt is not read
    assert decoded_token(tok, 0xA9, [ord("b")]) == ""  # a stray continuation byte
    assert decoded_token(tok, ord("x"), zhong[:2]) == "x"  # whole tokens are left alone
    argv = (*BASE, "--byte-level")
    events = chat(argv, max_tokens=200, return_token_ids=True)
    entries = content(events)
    ids = [t for e in events[1:] for t in e["choices"][0]["token_ids"]]
    pieces = [tok.pieces[t] for t in ids]
    split = [i for i, (e, p) in enumerate(zip(entries, pieces, strict=True))
             if e["token"] != p.decode("utf-8", "replace")]  # fmt: skip
    assert split, "the byte-level sim should split some character over tokens"
    for i in split:
        assert entries[i]["token"] == "" or "\ufffd" not in entries[i]["token"]


# -- the prefix property -----------------------------------------------------------------
@pytest.mark.parametrize("argv", [BASE, (*BASE, "--byte-level")])
def test_generate_on_a_prefix_continues_the_chat_stream(argv: tuple[str, ...]) -> None:
    ids = prompt_ids(argv)
    events = chat(argv, return_token_ids=True)
    out = [t for e in events[1:] for t in e["choices"][0]["token_ids"]]
    entries = content(events)
    texts = [e["choices"][0]["delta"].get("content", "") for e in events[1:]]
    tok = build_tokenizer(byte_level="--byte-level" in argv)
    cuts = [1, 5, 17, 30]
    inside = [k for k in range(1, 39) if tok.texts[out[k]].endswith("\ufffd")
              and tok.ends_mid_character(out[:k])]  # fmt: skip
    assert bool(inside) == tok.byte_level  # a cut inside a character, where there is one
    heads = []
    for k in cuts + inside[:2]:
        rest = generate(argv, [*ids, *out[:k]], sampling={"max_tokens": 40 - k})
        assert [t for e in rest for t in e["choices"][0]["token_ids"]] == out[k:]
        got = content(rest)
        # vLLM corrects a split character from this request's own sampled tokens only: where
        # the cut falls inside a character, the first tokens after it decode as on their own.
        head = 0
        while head < len(got) and tok.texts[out[k + head]].endswith("\ufffd"):
            head += 1
        assert got[head:] == entries[k + head:]
        assert all(e["token"] == "" for e in got[:head])  # no sampled context yet
        heads.append(head)
        assert [e["logprob"] for e in got] == [e["logprob"] for e in entries[k:]]
        if not tok.ends_mid_character(out[:k]):
            assert "".join(e["choices"][0]["text"] for e in rest) == "".join(texts[k:])
    assert any(heads) == tok.byte_level


def test_a_tool_call_script_token_ranks_first() -> None:
    model = ToyModel(ModelConfig(), build_tokenizer())
    lp = ChoiceLogprobs(model, "tokens", 2)
    lp.add([5, 6, 7], 9, forced=True)
    lp.add([5, 6, 7], EOS)
    (forced, tail) = lp.take()["content"]
    assert forced["rank"] == 1 and [t["token_id"] for t in forced["top_logprobs"]] == [9, 5]
    assert tail["rank"] > 3 and [t["token_id"] for t in tail["top_logprobs"]] == [EOS, 5]


# -- against vLLM's own code ---------------------------------------------------------------
VLLM_PY = Path.home() / ".cache/baton-engines/vllm-venv/bin/python"
TINY_BYTES = Path.home() / ".cache/baton-engines/model/tiny-bytes"
_VLLM_SCRIPT = r"""
import json, sys
import numpy as np
from transformers import AutoTokenizer
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsLists
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
spec = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(spec["tokenizer"])
k = spec["k"]
proc = LogprobsProcessor(tokenizer=tok, logprobs=[], prompt_logprobs=None,
                         cumulative_logprob=0.0, num_logprobs=k, num_prompt_logprobs=None)
for ids, lps, rank in spec["steps"]:
    proc._update_sample_logprobs(LogprobsLists(
        np.array([ids]), np.array([lps], dtype=np.float32), np.array([rank])))
sampled = [s[0][0] for s in spec["steps"]]
def bare(cls):
    obj = object.__new__(cls)
    obj.return_tokens_as_token_ids = False
    return obj
out = {
    "chat": bare(OpenAIServingChat)._create_chat_logprobs(
        sampled, proc.logprobs, tok, num_output_top_logprobs=k,
        return_as_token_id=False).model_dump(),
    "completion": bare(OpenAIServingCompletion)._create_completion_logprobs(
        sampled, proc.logprobs, k, tok, return_as_token_id=False).model_dump(),
    "text": bare(ServingTokens)._create_text_logprobs(sampled, proc.logprobs, k, tok).model_dump(),
    "tokens": bare(ServingTokens)._create_tokens_logprobs(sampled, proc.logprobs, k).model_dump(),
}
print(json.dumps(out))
"""


@pytest.mark.skipif(not (vllm_installed() and model_built("tiny-bytes")), reason="make engines")
@pytest.mark.parametrize("k", [0, 2])
def test_shapes_match_vllms_own_functions(k: int) -> None:
    """Byte tokens (ids = byte values in both vocabularies: the sim's default and vLLM's
    tiny-bytes) through vLLM's LogprobsProcessor and its serving functions, and through
    sim.logprobs: split, whole and invalid characters, a sampled token outside the top k,
    special tokens among the candidates."""
    tok = build_tokenizer()
    model = ToyModel(ModelConfig(), tok)
    text = [ord("a"), *"中".encode(), ord(" "), 0xC3, ord("b"), 0xA9, *"😀".encode(), EOS]
    rankings = [[(t + d) % 256 if d else t for d in range(6)] for t in text]
    rankings[2] = [0xE4, 0xB8, 0x41, 0xAD, 0xC3, 0x42]  # a lead byte among the candidates
    rankings[5] = [ord("c"), ord("d"), ord("e"), 0xC3, ord("f"), ord("g")]  # sampled: rank 4
    rankings[-1] = [EOS, 256, ord("z"), 0xF0, ord("y"), ord("x")]
    styles = ("chat", "completion", "text", "tokens")
    ours = {s: ChoiceLogprobs(model, s, k) for s in styles}  # type: ignore[arg-type]
    steps = []
    for t, ranking in zip(text, rankings, strict=True):
        for lp in ours.values():
            lp.add(ranking, t)
        rank = ranking.index(t) + 1
        ids = [t, *ranking[:k]]
        lps = [model.logprob(r) for r in (rank, *range(1, k + 1))]
        steps.append([ids, lps, rank])
    spec = {"tokenizer": str(TINY_BYTES), "k": k, "steps": steps}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(VLLM_PY), "-c", _VLLM_SCRIPT], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for s in styles:
        assert ours[s].take() == theirs[s], s


def test_generate_is_cut_at_the_same_seams() -> None:
    """X-Sim-Fault cuts /inference/v1/generate as it cuts /v1/completions."""
    ids = prompt_ids(BASE)
    sp = {"temperature": 0, "max_tokens": 20, "logprobs": 1}
    body = {"token_ids": ids, "sampling_params": sp, "output_mode": "text", "stream": True}

    async def raw(path: str, payload: dict[str, Any], fault: str) -> bytes:
        runner, port = await start_server(sim_config(*BASE), port=0)
        out = b""
        try:
            async with aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{port}{path}"
                async with s.post(url, json=payload, headers={"X-Sim-Fault": fault}) as r:
                    try:
                        async for chunk in r.content.iter_any():
                            out += chunk
                    except aiohttp.ClientPayloadError:
                        pass  # the cut
        finally:
            await runner.cleanup()
        return out

    cut = asyncio.run(raw("/inference/v1/generate", body, "die-after=3"))
    events = [orjson.loads(e.removeprefix(b"data: ")) for e in cut.split(b"\n\n") if e]
    assert b"[DONE]" not in cut and len(events) == 3
    assert all(len(e["choices"][0]["logprobs"]["content"]) == 1 for e in events)
    comp = {"prompt": ids, "max_tokens": 20, "stream": True, "return_token_ids": True}
    ccut = asyncio.run(raw("/v1/completions", comp, "die-after=3"))
    cevents = [orjson.loads(e.removeprefix(b"data: ")) for e in ccut.split(b"\n\n") if e]
    assert [e["choices"][0]["token_ids"] for e in cevents] == [
        e["choices"][0]["token_ids"] for e in events
    ]
    aborted = asyncio.run(raw("/inference/v1/generate", body, "abort-after=2"))
    *_, last, done = [e for e in aborted.split(b"\n\n") if e]
    (c,) = orjson.loads(last.removeprefix(b"data: "))["choices"]
    assert done == b"data: [DONE]" and c["finish_reason"] == "abort"
    assert c["token_ids"] == [] and c["logprobs"] == {"content": []} and c["text"] == ""
