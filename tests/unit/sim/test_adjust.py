"""skip_special_tokens as a request sets it and as vLLM 0.32's tool parsers' adjust_request
leaves it (sim.adjust), and what a stream and /v1/completions then show of a special tag."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from sim.adjust import adjusted, keeps_special
from sim.config import SimConfig
from sim.costmodel import CostParams
from sim.model import ModelConfig
from sim.protocol import Limits, parse_chat, parse_completion
from sim.tokenizer import build_tokenizer
from tests.unit.sim.test_tools import post

FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_xml")
TOK = build_tokenizer(reasoning=True, tool_calls=True, think_special=True)
LIMITS = Limits(model="toy", max_model_len=4096, default_max_tokens=64, default_temperature=0.0)
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


@pytest.mark.parametrize(
    ("parser", "reasoning", "tools", "choice_none", "want"),
    [
        # hermes: only for a request offering tools with tool_choice other than "none"
        ("hermes", False, True, False, True),
        ("hermes", True, True, False, True),
        ("hermes", False, True, True, False),
        ("hermes", True, True, True, False),
        ("hermes", True, False, True, False),
        ("hermes", False, False, False, False),  # tool_choice null, no tools
        # mistral (legacy) and qwen3_xml: whenever adjust_request runs, tools or not
        ("mistral", False, True, False, True),
        ("mistral", False, True, True, False),  # tool_choice "none": it does not run
        ("mistral", True, False, True, True),  # a reasoning parser: it runs for every chat
        ("mistral", False, False, False, True),
        ("qwen3_xml", False, True, False, True),
        ("qwen3_xml", True, False, True, True),
        ("qwen3_xml", False, False, True, False),
        # llama3_json: the base ToolParser's, which leaves it
        ("llama3_json", False, True, False, False),
        ("llama3_json", True, True, False, False),
        # no tool parser (--enable-auto-tool-choice off): deepseek_r1 leaves it
        (None, True, True, False, False),
    ],
)
def test_which_parsers_turn_skip_special_tokens_off(
    parser: str | None, reasoning: bool, tools: bool, choice_none: bool, want: bool
) -> None:
    got = keeps_special(parser, reasoning=reasoning, tools=tools, tool_choice_none=choice_none)
    assert got is want


def chat(**body: Any) -> Any:
    return parse_chat({"model": "toy", "messages": MSGS, **body}, TOK, LIMITS)


def test_requests_carry_skip_special_tokens_and_the_resolved_tool_choice() -> None:
    assert chat().params.skip_special_tokens and chat().tool_choice_none
    assert not chat(skip_special_tokens=False).params.skip_special_tokens
    assert not chat(tools=[WEATHER]).tool_choice_none  # absent with tools: "auto"
    assert chat(tools=[WEATHER], tool_choice="none").tool_choice_none
    assert not chat(tool_choice=None).tool_choice_none  # an explicit null is not "none"
    done = parse_completion({"prompt": "hi", "skip_special_tokens": False}, TOK, LIMITS)
    assert not done.params.skip_special_tokens
    with pytest.raises(Exception, match="skip_special_tokens"):
        chat(skip_special_tokens="no")


def test_adjusted_turns_it_off_for_chat_only_and_never_on() -> None:
    with_tools = chat(tools=[WEATHER])
    assert not adjusted(with_tools, "hermes", reasoning=False).params.skip_special_tokens
    assert adjusted(with_tools, None, reasoning=True) is with_tools
    assert adjusted(chat(), "hermes", reasoning=True).params.skip_special_tokens
    assert not adjusted(chat(), "qwen3_xml", reasoning=True).params.skip_special_tokens
    done = parse_completion({"prompt": "hi"}, TOK, LIMITS)
    assert adjusted(done, "qwen3_xml", reasoning=True) is done  # completions run no parser
    off = chat(skip_special_tokens=False)
    assert adjusted(off, "llama3_json", reasoning=False) is off  # the client's own stays


# -- over HTTP: a sim whose think tags are special tokens ------------------------------------
def cfg(fmt: str = "hermes", **kw: Any) -> SimConfig:
    model = ModelConfig(think_tokens=10, tool_call_after=4, tool_format=fmt)
    return SimConfig(model=model, limits=LIMITS, cost=CostParams(0.0, 0.0), reasoning=True,
                     think_special=True, tool_calls=True, **kw)  # fmt: skip


def fields(events: list[Any]) -> dict[str, Any]:
    """What a client assembles of a chat stream: reasoning, content, call names."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": []}
    for e in events:
        for c in e["choices"]:
            d = c["delta"]
            out["reasoning"] += d.get("reasoning") or ""
            out["content"] += d.get("content") or ""
            out["calls"] += [tc["function"]["name"] for tc in d.get("tool_calls") or ()
                             if "name" in tc["function"]]  # fmt: skip
    return out


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "toy", "messages": MSGS, "max_tokens": 300, "stream": True, **kw}


def test_tools_show_a_special_end_tag_so_merged_chunks_split_right() -> None:
    """Offering tools turns skip_special_tokens off (hermes): the reasoning parser finds the
    tag's text in a merged chunk, so three tokens a chunk assemble as one token a chunk do.
    Without tools the tag is skipped, and vLLM's parser (the sim's) mis-splits such a chunk
    unless the tag falls at a chunk's edge."""
    one = post(cfg(), "/v1/chat/completions", body(tools=[WEATHER], return_token_ids=True))[1]
    ids = [t for e in one[1:] for t in e["choices"][0]["token_ids"]]
    assert TOK.think_end in ids
    want = fields(one)
    assert want["reasoning"] and want["calls"] == ["get_weather"]
    assert "</think>" not in want["reasoning"] + want["content"]
    for per_chunk in (2, 3, 4):
        merged = post(cfg(), "/v1/chat/completions",
                      body(tools=[WEATHER], stream_interval=per_chunk))[1]  # fmt: skip
        assert fields(merged) == want, per_chunk
    at = ids.index(TOK.think_end)
    mis = next(n for n in (2, 3, 4) if at % n not in (0, n - 1))  # the tag mid-chunk
    bare = fields(post(cfg(), "/v1/chat/completions", body())[1])
    assert fields(post(cfg(), "/v1/chat/completions", body(stream_interval=mis))[1]) != bare


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_chat_without_tools_shows_the_tag_where_the_parser_says(fmt: str) -> None:
    """Non-streaming, the reasoning is cut at the tag's text: a skipped tag leaves all of
    it reasoning. On a server with a reasoning parser, mistral and qwen3_xml turn
    skip_special_tokens off for every chat request; hermes and llama3_json do not."""
    _, (done,) = post(cfg(fmt), "/v1/chat/completions", body(stream=False))
    msg = done["choices"][0]["message"]
    shown = fmt in ("mistral", "qwen3_xml")
    assert msg["reasoning"] and (msg["content"] is not None) is shown, msg
    asked = body(stream=False, skip_special_tokens=False)
    _, (done,) = post(cfg(fmt), "/v1/chat/completions", asked)
    assert done["choices"][0]["message"]["content"] is not None  # the client's own setting


def test_completions_and_generate_decode_a_special_tag_as_asked() -> None:
    prompt = TOK.encode("<|bos|><|user|>Why?<|end|><|assistant|><think>")
    base = {"model": "toy", "prompt": prompt, "max_tokens": 60}
    texts: dict[bool, str] = {}
    for skip in (True, False):
        for stream in (False, True):
            _, events = post(cfg(), "/v1/completions",
                             {**base, "stream": stream, "skip_special_tokens": skip})  # fmt: skip
            text = "".join(c["text"] for e in events for c in e["choices"])
            assert texts.setdefault(skip, text) == text  # streamed = whole
    assert "</think>" not in texts[True] and texts[False].count("</think>") == 1
    assert texts[False].replace("</think>", "") == texts[True]
    scale_out = replace(cfg(), enable_scale_out=True)
    gen = {
        "token_ids": prompt,
        "output_mode": "text",
        "sampling_params": {"max_tokens": 60, "temperature": 0, "skip_special_tokens": False},
    }
    status, (out,) = post(scale_out, "/inference/v1/generate", gen)
    assert status == 200 and out["choices"][0]["text"] == texts[False]
