"""The sim's tool calls in four formats: a function of the token ids, resumable at any cut."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
import pytest

from sim.config import SimConfig
from sim.costmodel import CostParams
from sim.model import ModelConfig
from sim.protocol import Limits
from sim.server import start_server
from sim.tokenizer import EOS, build_tokenizer

FORMATS = ["hermes", "llama3_json", "mistral", "qwen3_xml"]
TOK = build_tokenizer(tool_calls=True)
LIMITS = Limits(model="toy", max_model_len=4096, default_max_tokens=64, default_temperature=0.0)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}}}  # fmt: skip
LOOKUP = {"type": "function", "function": {"name": "lookup"}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def cfg(fmt: str, parallel: int = 1, after: int = 6) -> SimConfig:
    model = ModelConfig(tool_format=fmt, parallel_tool_calls=parallel, tool_call_after=after)
    return SimConfig(model=model, limits=LIMITS, cost=CostParams(0.0, 0.0), tool_calls=True)


async def _post(s: aiohttp.ClientSession, port: int, path: str, body: dict[str, Any]) -> Any:
    async with s.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
        raw = await r.read()
        assert r.status == 200, raw
    if not body.get("stream"):
        return orjson.loads(raw)
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def serve(config: SimConfig, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Each (path, body) posted in turn to one in-process sim on a free port."""

    async def go() -> list[Any]:
        runner, port = await start_server(config, port=0)
        try:
            async with aiohttp.ClientSession() as s:
                return [await _post(s, port, path, body) for path, body in calls]
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def chat(**kw: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": "toy", "messages": MSGS, "max_tokens": 200, "tools": [WEATHER], **kw}
    return "/v1/chat/completions", body


def assemble(events: list[Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    """A client's view of a chat stream: content, calls (id, name, arguments), finish."""
    content, calls, finish = "", [], None
    for e in events:
        (choice,) = e["choices"]
        d = choice["delta"]
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or ():
            if tc["index"] == len(calls):
                calls.append({"id": tc["id"], "name": "", "arguments": ""})
            fn = tc.get("function") or {}
            calls[tc["index"]]["name"] += fn.get("name") or ""
            calls[tc["index"]]["arguments"] += fn.get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    return content, calls, finish


def check_args(args: str) -> dict[str, Any]:
    parsed = json.loads(args)
    assert isinstance(parsed["city"], str) and "é" in parsed["city"] and '"' in parsed["city"]
    assert '\\"' in args  # the quote went out escaped
    return dict(parsed)


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_stream_assembles_to_the_call(fmt: str, interval: int) -> None:
    (events, whole) = serve(cfg(fmt), [chat(stream=True, stream_interval=interval), chat()])
    content, calls, finish = assemble(events[1:])
    assert finish == "tool_calls"
    (call,) = calls
    assert call["name"] == "get_weather"
    args = check_args(call["arguments"])
    assert isinstance(args["days"], int) and args["days"] >= 10
    if fmt == "mistral":
        assert len(call["id"]) == 9 and call["id"].isalnum()
    else:
        assert call["id"].startswith("chatcmpl-tool-")
    assert bool(content) == (fmt != "llama3_json")  # llama3_json calls open the answer
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": call["arguments"]}
    ]
    assert (choice["message"]["content"] or "") == content


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_calls_take_the_first_tools_unless_the_request_says_one(fmt: str) -> None:
    tools = [WEATHER, LOOKUP]
    many, one = serve(cfg(fmt, parallel=3), [
        chat(stream=True, stream_interval=2, tools=tools),
        chat(stream=True, tools=tools, parallel_tool_calls=False),
    ])  # fmt: skip
    _, calls, finish = assemble(many[1:])
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather", "lookup"]
    assert list(check_args(calls[1]["arguments"])) == ["city"]  # no properties: "city"
    assert len({c["id"] for c in calls}) == 2
    assert [c["name"] for c in assemble(one[1:])[1]] == ["get_weather"]


def _cuts(ids: list[int]) -> dict[str, int]:
    """Named cut points k (resume after the first k generated ids)."""
    starts = {TOK.tool_call_start, TOK.python_tag, TOK.tool_calls_tag}
    s = next(i for i, t in enumerate(ids) if t in starts)
    out = {"content": max(0, s - 2), "start tag": s, "after start tag": s + 1}
    out["name"] = next(i for i in range(s, len(ids)) if TOK.decode(ids[s:i]).endswith("get_w"))
    out["mid-string"] = ids.index(0xC3, s) + 1  # between the two bytes of "é"
    quote = ids.index(0x22, out["mid-string"])
    out["mid-escape"] = quote if ids[quote - 1] == 0x5C else quote - 1  # "\\|"" or "x|""
    digits = [i for i, t in enumerate(ids) if s < i and 0x30 <= t <= 0x39]
    out["mid-number"] = digits[1]
    if TOK.tool_call_end in ids:
        out["end tag"] = ids.index(TOK.tool_call_end)
        out["after end tag"] = out["end tag"] + 1
    out["between calls"] = max(i for i, t in enumerate(ids) if t in starts)
    out["eos"] = len(ids) - 1
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_completions_over_the_prompt_and_any_prefix_continue_the_same_tokens(fmt: str) -> None:
    tools = [WEATHER, LOOKUP]
    (events,) = serve(cfg(fmt, parallel=2), [chat(stream=True, tools=tools,
                                                  return_token_ids=True)])  # fmt: skip
    prompt = events[0]["prompt_token_ids"]
    ids = [t for e in events[1:] for t in e["choices"][0]["token_ids"]]
    assert ids[-1] == EOS and assemble(events[1:])[2] == "tool_calls"
    cuts = _cuts(ids)
    assert TOK.decode(ids[cuts["mid-string"] - 1 : cuts["mid-string"] + 1]) == "é"
    bodies = [
        ("/v1/completions", {"model": "toy", "prompt": prompt + ids[:k], "max_tokens": 200,
                             "return_token_ids": True, "temperature": 0})
        for k in cuts.values()
    ]  # fmt: skip
    for (name, k), body in zip(cuts.items(), serve(cfg(fmt, parallel=2), bodies), strict=True):
        (choice,) = body["choices"]
        assert choice["token_ids"] == ids[k:], name
        assert choice["finish_reason"] == "stop", name


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tool_result_gets_a_plain_answer_that_ends(fmt: str) -> None:
    msgs = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"},
    ]  # fmt: skip
    streamed, whole = serve(cfg(fmt), [chat(messages=msgs, stream=True, return_token_ids=True),
                                       chat(messages=msgs)])  # fmt: skip
    content, calls, finish = assemble(streamed[1:])
    ids = [t for e in streamed[1:] for t in e["choices"][0]["token_ids"]]
    assert calls == [] and finish == "stop" and content and ids[-1] == EOS
    assert len(ids) < 200  # ended on its own
    (choice,) = whole["choices"]
    assert choice["message"]["content"] == content and not choice["message"]["tool_calls"]


def test_tool_choice_none_and_no_tools_are_served_as_without_the_mode() -> None:
    plain = replace(cfg("hermes"), tool_calls=False)
    for body in (chat(tool_choice="none", stream=True), chat(tools=None, stream=True)):
        (a,), (b,) = serve(cfg("qwen3_xml"), [body]), serve(plain, [body])
        strip = [{k: v for k, v in e.items() if k not in ("id", "created")} for e in a]
        assert strip == [{k: v for k, v in e.items() if k not in ("id", "created")} for e in b]
