"""Tool-call mode: <tool_call> tokens, the request, the model's call, vLLM's hermes parser."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
import pytest

from sim.chat_template import Message, render
from sim.config import SimConfig
from sim.costmodel import CostParams
from sim.generation import Sequence
from sim.model import ModelConfig, ToyModel
from sim.protocol import ApiError, Limits, SamplingParams, parse_chat, parse_completion
from sim.responses import ChoiceResult, Meta, full_response
from sim.server import start_server
from sim.tokenizer import (
    EOS,
    THINK_END,
    TOOL_CALL_END,
    TOOL_CALL_START,
    Tokenizer,
    build_tokenizer,
)
from sim.tool_script import ToolCallPlan
from sim.tools import ToolSpec, ToolStream, extract
from tests.factories import sim_config

TOK = build_tokenizer(tool_calls=True)
PLAIN = build_tokenizer()


def tags(tok: Tokenizer) -> tuple[int, int]:
    assert tok.tool_call_start is not None and tok.tool_call_end is not None
    return tok.tool_call_start, tok.tool_call_end


START, END = tags(TOK)
LIMITS = Limits(model="toy", max_model_len=4096, default_max_tokens=64, default_temperature=0.0)
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}
TOOL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")


# -- the flags ---------------------------------------------------------------------------
def test_flags_reach_the_config() -> None:
    off = sim_config()
    assert not off.tool_calls and off.model.tool_call_after == 8
    on = sim_config("--tool-calls", "--tool-call-after", "3")
    assert on.tool_calls and on.model.tool_call_after == 3
    with pytest.raises(SystemExit, match="--tool-call-after"):
        sim_config("--tool-calls", "--tool-call-after", "-1")


# -- the vocabulary ----------------------------------------------------------------------
def test_tool_call_tags_are_added_tokens_that_decoding_keeps() -> None:
    assert (START, END) == (TOK.merge_end, TOK.merge_end + 1)
    assert TOK.encode("a<tool_call>b</tool_call>c") == [97, START, 98, END, 99]
    assert TOK.decode([START, 98, END], skip_special_tokens=True) == "<tool_call>b</tool_call>"
    assert TOK.vocab_hash() != PLAIN.vocab_hash()
    assert PLAIN.encode(TOOL_CALL_START) != [START] and PLAIN.tool_call_start is None
    both = build_tokenizer(reasoning=True, tool_calls=True)
    assert (both.think_start, both.think_end, both.tool_call_start) == (
        both.merge_end, both.merge_end + 1, both.merge_end + 2,
    )  # fmt: skip
    assert both.encode("<think></think><tool_call>") == [
        both.think_start, both.think_end, both.tool_call_start,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "text",
    ["<|bos|><|user|>Hi?<|end|><|assistant|>", "x?<|end|> the model", "a < b > c", "<tool", ""],
)
def test_text_without_the_tags_encodes_as_in_the_default_vocabulary(text: str) -> None:
    # The default pre-tokenizer's quirk (a special right after punctuation is bytes) stays.
    assert TOK.encode(text) == PLAIN.encode(text)


# -- the request -------------------------------------------------------------------------
def chat(tok: Tokenizer = TOK, **body: Any) -> Any:
    return parse_chat({"messages": MSGS, **body}, tok, LIMITS)


def test_tools_with_auto_or_no_tool_choice_make_a_call_spec() -> None:
    assert chat(tools=[WEATHER]).tool == ToolSpec((WEATHER,))
    assert chat(tools=[WEATHER], tool_choice="auto").tool == ToolSpec((WEATHER,))
    assert chat(tools=[WEATHER], tool_choice=None).tool is not None  # null acts as auto
    assert chat(tools=[WEATHER], parallel_tool_calls=False).tool == ToolSpec((WEATHER,), False)
    # The tools are rendered into the prompt (sim.tool_prompt): the model reads them there.
    assert len(chat(tools=[WEATHER]).prompt_ids) > len(chat().prompt_ids)


def test_no_tools_or_tool_choice_none_is_no_call() -> None:
    assert chat().tool is None
    assert chat(tools=[WEATHER], tool_choice="none").tool is None
    assert chat(tool_choice="none").tool is None
    assert chat(tool_choice=None).tool is None
    assert parse_completion({"prompt": "x", "tools": [WEATHER]}, TOK, LIMITS).tool is None
    # The mode off: tools are ignored, malformed or not (as before the mode existed).
    assert chat(PLAIN, tools=[WEATHER]).tool is None
    assert chat(PLAIN, tools=[], tool_choice="required").tool is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": []}, "tools", "must not be an empty array"),
        ({"tools": {"name": "f"}}, "tools", "list"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "tools[0]"),
        ({"tools": [{"function": {"name": 3}}]}, "tools", "tools[0]"),
        ({"tools": [{"function": {"name": "f", "parameters": []}}]}, "tools", "tools[0]"),
        ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "not supported"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice", "not supported",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "Invalid value"),
    ],
)
def test_bad_tools_or_tool_choice_are_400(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as err:
        chat(**body)
    assert (err.value.status, err.value.param) == (400, param)
    assert words in err.value.message


# -- the model ---------------------------------------------------------------------------
def prompt(tok: Tokenizer = TOK, spec: ToolSpec | None = None) -> list[int]:
    tools = spec.tools if spec else [WEATHER_FN]
    return tok.encode(render([Message("user", "weather?")], tools=tools,
                             open_think=tok.think_start is not None))  # fmt: skip


WEATHER_FN = {"type": "function", "function": {"name": "get_weather"}}


def generate(
    model: ToyModel, ids: list[int], n: int, *, plan: bool = True, **params: Any
) -> Sequence:
    seq = Sequence(model, ids, SamplingParams(max_tokens=n, **params),
                   tool=ToolCallPlan(model, ids) if plan else None)  # fmt: skip
    while not seq.finished:
        seq.step()
    return seq


def call_of(text: str) -> dict[str, Any]:
    body = text[text.index(TOOL_CALL_START) + len(TOOL_CALL_START) : text.index(TOOL_CALL_END)]
    parsed: dict[str, Any] = json.loads(body)
    return parsed


@pytest.mark.parametrize("after", [0, 1, 8, 30])
def test_the_call_comes_after_n_tokens_then_eos(after: int) -> None:
    for seed in range(5):
        model = ToyModel(ModelConfig(seed=seed, tool_call_after=after), TOK)
        plain = generate(model, prompt(), 200, plan=False)
        seq = generate(model, prompt(), 200)
        ids = seq.token_ids
        assert ids[:after] == plain.token_ids[:after]  # the model's own text first
        assert ids[after] == START and ids.count(START) == ids.count(END) == 1
        assert ids[-1] == EOS and ids[-2] == END and seq.finish_reason == "stop"
        text = seq.output_text()
        assert text.startswith(TOK.decode(plain.token_ids[:after]) + TOOL_CALL_START)
        assert text.endswith(TOOL_CALL_END)
        call = call_of(text)
        assert list(call) == ["name", "arguments"] and call["name"] == "get_weather"
        (value,) = call["arguments"].values()
        assert list(call["arguments"]) == ["city"]
        assert re.fullmatch(r'[A-Z][a-z]{1,3}é[a-z]"[a-z]{1,2}', value), value
        # The whole script is greedy, deterministic: the same call every time.
        assert generate(model, prompt(), 200).token_ids == ids


def test_the_call_is_the_same_on_every_chip_and_fills_the_declared_argument() -> None:
    spec = ToolSpec(({"function": {"name": 'we"ird', "parameters": WEATHER["function"]
                                   ["parameters"]}},))  # fmt: skip
    outs = {
        tuple(generate(ToyModel(ModelConfig(chip_seed=c), TOK), prompt(spec=spec), 100).token_ids)
        for c in range(4)
    }
    assert len(outs) == 1
    (ids,) = outs
    call = call_of(TOK.decode(list(ids)))
    assert call["name"] == 'we"ird' and list(call["arguments"]) == ["location"]
    # Values differ with the history: another prompt, another city.
    model = ToyModel(ModelConfig(), TOK)
    other = TOK.encode(render([Message("user", "and in Rome?")], tools=spec.tools))
    assert call_of(generate(model, other, 100).output_text()) != call


def test_the_plan_bends_to_the_request_limits() -> None:
    model = ToyModel(ModelConfig(tool_call_after=4), TOK)
    cut = generate(model, prompt(), 12)  # max_tokens inside the call
    assert cut.finish_reason == "length" and cut.token_ids[4] == START and END not in cut.token_ids
    free = generate(model, prompt(), 80, ignore_eos=True)  # no EOS: the model goes on
    j = free.token_ids.index(END)
    assert EOS not in free.token_ids and len(free.token_ids) == 80
    assert free.token_ids[j + 1 :] and START not in free.token_ids[j + 1 :]  # one call only
    late = generate(model, prompt(), 200, min_tokens=150)
    assert late.token_ids.index(END) < 150 <= len(late.token_ids)
    sampled = generate(model, prompt(), 200, temperature=1.0, seed=7)
    assert sampled.token_ids[4] == START and sampled.finish_reason == "stop"


def test_run_to_end_takes_the_stepping_path_with_a_plan() -> None:
    model = ToyModel(ModelConfig(), TOK)
    seq = Sequence(model, prompt(), SamplingParams(max_tokens=200),
                   tool=ToolCallPlan(model, prompt()))  # fmt: skip
    seq.run_to_end()
    assert seq.token_ids == generate(model, prompt(), 200).token_ids


def test_byte_level_the_call_starts_on_a_whole_character() -> None:
    tok = build_tokenizer(byte_level=True, tool_calls=True)
    for seed in range(20):
        model = ToyModel(ModelConfig(seed=seed, tool_call_after=6), tok)
        seq = generate(model, prompt(tok), 300)
        j = seq.token_ids.index(tags(tok)[0])
        assert j >= 6
        before = tok.decode(seq.token_ids[:j], skip_special_tokens=True)
        assert not before.endswith("\ufffd")  # nothing held back when the call starts
        assert seq.output_text().startswith(before + TOOL_CALL_START)
        assert call_of(seq.output_text())["name"] == "get_weather"


def test_reasoning_the_call_comes_after_thinking() -> None:
    tok = build_tokenizer(reasoning=True, tool_calls=True)
    ids = prompt(tok)
    for seed in range(5):
        model = ToyModel(ModelConfig(seed=seed, think_tokens=12, tool_call_after=4), tok)
        out = generate(model, ids, 300).token_ids
        assert tok.think_end is not None
        assert out.index(tok.think_end) < out.index(tags(tok)[0])


# -- the parser: streaming ---------------------------------------------------------------
def run_stream(pieces: Seq[str], **kw: Any) -> list[dict[str, Any] | None]:
    ts = ToolStream(**kw)
    return [ts.delta(p, (), finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]


def no_ids(deltas: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    for d in deltas:
        for tc in (d or {}).get("tool_calls", ()):
            if "id" in tc:
                assert TOOL_ID.match(tc.pop("id"))
    return deltas


def fn(i: int, **f: str) -> dict[str, Any]:
    return {"content": None, "tool_calls": [{"index": i, "function": f}]}


def name(i: int, n: str) -> dict[str, Any]:
    call = {"type": "function", "index": i, "function": {"name": n}}
    return {"content": None, "tool_calls": [call]}


# Expected deltas checked against vLLM 0.32's Hermes2ProToolParser (driven as parse_delta does).
def test_stream_content_then_name_then_argument_fragments() -> None:
    pieces = [
        "Let", " me<", "tool", "_call>", '{"name', '": "get', '_weather"', ', "arguments": ',
        '{"city', '": "Pa', 'ris"}', "}", "</tool", "_call>", "",
    ]  # fmt: skip
    assert no_ids(run_stream(pieces)) == [
        {"content": "Let"}, {"content": " me"},  # "<" held back: it may start the tag
        None, None, None, None, name(0, "get_weather"),  # once the name is complete
        None,  # "arguments": found, nothing after it yet
        fn(0, arguments='{"city'), fn(0, arguments='": "Pa'), fn(0, arguments='ris"}'),
        None,  # the call object's own brace: complete JSON, that brace is dropped
        None, None, None,
    ]  # fmt: skip
    # Held back, then not the tag after all: it goes out with the next text.
    assert run_stream(["a<", "b", " c<tool_ca", "ll>x"]) == [
        {"content": "a"}, {"content": "<b"}, {"content": " c"}, None,
    ]  # fmt: skip


def test_stream_text_after_a_call_is_dropped_and_calls_are_indexed() -> None:
    a = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    b = '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    got = no_ids(run_stream([a, " between ", b, " after"]))
    assert got == [
        {"content": None, "tool_calls": [
            {"type": "function", "index": 0, "function": {"name": "a"}},
            {"index": 0, "function": {"arguments": "{}"}},
        ]},
        None,
        {"content": None, "tool_calls": [
            {"type": "function", "index": 1, "function": {"name": "b"}},
            {"index": 1, "function": {"arguments": '{"x": 1}'}},
        ]},
        None,
    ]  # fmt: skip


def test_stream_finish_appends_unstreamed_arguments() -> None:
    # Cut (max_tokens) right after the name: vLLM adds the arguments it has parsed ("{}").
    assert no_ids(run_stream(['<tool_call>{"name": "f"'])) == [
        {"content": None, "tool_calls": [
            {"type": "function", "index": 0, "function": {"name": "f", "arguments": "{}"}},
        ]},
    ]  # fmt: skip
    assert no_ids(run_stream(['<tool_call>{"name": "f", "arguments": {"a"'])) == [
        {"content": None, "tool_calls": [
            {"type": "function", "index": 0, "function": {"name": "f"}},
            {"index": 0, "function": {"arguments": '{"a"'}},
        ]},
    ]  # fmt: skip


def test_stream_finish_reason_becomes_tool_calls_once_a_call_went_out() -> None:
    ts = ToolStream()
    assert ts.finish_reason("stop") == "stop"
    ts.delta('<tool_call>{"name": "f"', ())
    assert ts.called
    assert (ts.finish_reason("stop"), ts.finish_reason("length")) == ("tool_calls", "length")
    partial = ToolStream()
    partial.delta("<tool_call>{", ())  # the tag, but no name yet: nothing streamed
    assert partial.finish_reason("stop") == "stop"


def test_stream_after_reasoning_parses_the_content_only() -> None:
    tok = build_tokenizer(reasoning=True, tool_calls=True)
    ts, te = tok.think_start, tok.think_end
    assert ts is not None and te is not None
    got = no_ids([
        (s := ToolStream((ts, te))).delta("Hm", (1,)),
        s.delta(THINK_END, (te,)),  # the end token alone: skipped
        s.delta("ok", (2,)),
        s.delta("<tool_call>", (tags(tok)[0],)),
        s.delta('{"name": "f"', (3,)),
    ])  # fmt: skip
    assert got == [{"reasoning": "Hm"}, None, {"content": "ok"}, None, name(0, "f")]
    # The end token among others: the reasoning rides on the tool parser's delta.
    s2 = ToolStream((ts, te))
    assert s2.delta("a</think>b", (1, te, 2)) == {"content": "b", "reasoning": "a"}
    s3 = ToolStream((ts, te))
    assert s3.delta("a</think><tool_call>", (1, te, 4)) == {"reasoning": "a"}
    assert no_ids([s3.delta('{"name": "g"', (5,))]) == [name(0, "g")]
    hidden = ToolStream((ts, te), include_reasoning=False)
    assert hidden.delta("a", (1,)) is None
    assert hidden.delta("a</think>b", (1, te, 2)) == {"content": "b"}


# -- the parser: non-streaming -----------------------------------------------------------
def test_extract_calls_and_content() -> None:
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "é"}}\n</tool_call>'
    content, calls = extract(text)
    assert content == "Sure. "
    (call,) = calls
    assert TOOL_ID.match(call.pop("id"))
    assert call == {"type": "function", "function": {"name": "f", "arguments": '{"a": "é"}'}}
    # No text before the call, or only blanks: null content. An unclosed last call counts.
    assert extract('  <tool_call>{"name": "f", "arguments": {}}')[0] is None
    two = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": 1}'
    )
    assert [c["function"]["name"] for c in extract(two)[1]] == ["a", "b"]
    # Anything unparseable: the whole text is content, no calls.
    for bad in ("x<tool_call>{", 'x<tool_call>{"name": "f"}</tool_call>',
                '<tool_call>["f"]</tool_call>', '<tool_call>{"name": 1, "arguments": {}}'):
        assert extract(bad) == (bad, [])
    assert extract("no call") == ("no call", [])


def test_full_response_has_tool_calls_and_finish_reason() -> None:
    meta = Meta("id", 0, "toy", "fp", chat=True, return_token_ids=False, include_usage=False,
                tools=True)  # fmt: skip
    text = 'ok<tool_call>{"name": "f", "arguments": {"c": "X"}}</tool_call>'
    body = full_response(meta, [1], [ChoiceResult(text, [2, 3], "stop")])
    (choice,) = body["choices"]
    msg = choice["message"]
    assert msg["content"] == "ok" and choice["finish_reason"] == "tool_calls"
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"c": "X"}'}
    cut = full_response(meta, [1], [ChoiceResult("ok<tool_call>{", [2], "length")])
    assert cut["choices"][0]["message"] == {"role": "assistant", "content": "ok<tool_call>{",
                                            "tool_calls": []}  # fmt: skip
    assert cut["choices"][0]["finish_reason"] == "length"
    off = full_response(replace(meta, tools=False), [1], [ChoiceResult(text, [2, 3], "stop")])
    assert off["choices"][0]["message"]["content"] == text  # no parser: raw text


# -- over HTTP ---------------------------------------------------------------------------
CFG = SimConfig(model=ModelConfig(), limits=LIMITS, cost=CostParams(0.0, 0.0))
TOOLS_CFG = replace(CFG, tool_calls=True)


def post(cfg: SimConfig, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """Status and the JSON body (non-streaming) or every SSE event (streaming)."""

    async def go() -> tuple[int, list[Any]]:
        runner, port = await start_server(cfg, port=0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
                    raw = await r.read()
        finally:
            await runner.cleanup()
        if not body.get("stream"):
            return r.status, [orjson.loads(raw)]
        events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"[DONE]"
        return r.status, [orjson.loads(e) for e in events[:-1]]

    return asyncio.run(go())


def stable(events: list[Any]) -> list[Any]:
    """Without what differs between any two responses (ids, timestamps)."""
    out = []
    for e in events:
        e = {k: v for k, v in e.items() if k not in ("id", "created")}
        out.append(json.loads(re.sub(r"chatcmpl-tool-[0-9a-f]{16}", "ID", json.dumps(e))))
    return out


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "toy", "messages": MSGS, "max_tokens": 120, **kw}


def test_streamed_tool_call_over_http() -> None:
    body = chat_body(stream=True, tools=[WEATHER])
    status, events = post(TOOLS_CFG, "/v1/chat/completions", body)
    assert status == 200
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = [d["content"] for d in deltas[1:] if d.get("content")]
    assert len(content) == 8  # one token each before the call (--tool-call-after 8)
    calls = [tc for d in deltas for tc in d.get("tool_calls", ())]
    assert calls[0]["type"] == "function" and TOOL_ID.match(calls[0]["id"])
    assert calls[0]["function"] == {"name": "get_weather"} and calls[0]["index"] == 0
    assert all(set(tc) == {"index", "function"} for tc in calls[1:])
    args = "".join(tc["function"]["arguments"] for tc in calls[1:])
    assert list(json.loads(args)) == ["location"]
    assert all(d["content"] is None for d in deltas if "tool_calls" in d)
    assert not any(TOOL_CALL_START in (d.get("content") or "") for d in deltas)
    last = events[-1]["choices"][0]
    assert (last["delta"], last["finish_reason"], last["stop_reason"]) == ({}, "tool_calls", None)
    assert events[-1]["system_fingerprint"] == "sim-0"
    # Non-streaming: the same call, parsed whole.
    _, (body,) = post(TOOLS_CFG, "/v1/chat/completions", chat_body(tools=[WEATHER]))
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "".join(content)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": args}


def test_return_token_ids_sends_every_token_and_completions_resume_the_call() -> None:
    _, events = post(TOOLS_CFG, "/v1/chat/completions", chat_body(
        stream=True, tools=[WEATHER], return_token_ids=True,
    ))  # fmt: skip
    ids = [t for e in events[1:] for t in e["choices"][0]["token_ids"]]
    assert ids[8] == START and ids[-1] == EOS and len(ids) == len(events) - 1
    assert {} in [e["choices"][0]["delta"] for e in events]  # skipped chunks, kept for ids
    _, (body,) = post(TOOLS_CFG, "/v1/completions", {
        "model": "toy", "prompt": events[0]["prompt_token_ids"] + ids[:8], "max_tokens": 120,
        "return_token_ids": True,
    })  # fmt: skip
    # A resume over /v1/completions runs no parser, and the model (reading the tools in
    # the prompt ids) writes the same call: the raw text, the same ids.
    assert TOOL_CALL_START in body["choices"][0]["text"]
    assert body["choices"][0]["token_ids"] == ids[8:]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {}),
        ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "none"}),
        ("/v1/chat/completions", {"return_token_ids": True, "n": 2}),
        ("/v1/completions", {"tools": [WEATHER]}),
    ],
)
def test_requests_the_mode_does_not_parse_are_unchanged(
    path: str, extra: dict[str, Any], stream: bool
) -> None:
    body = chat_body(stream=stream, **extra)
    if path == "/v1/completions":
        body = {"model": "toy", "prompt": "weather?", "max_tokens": 60, "stream": stream, **extra}
    with_mode, without = post(TOOLS_CFG, path, body), post(CFG, path, body)
    assert stable(with_mode[1]) == stable(without[1])


def test_flag_off_ignores_tools() -> None:
    _, events = post(CFG, "/v1/chat/completions", chat_body(stream=True, tools=[WEATHER]))
    _, plain = post(CFG, "/v1/chat/completions", chat_body(stream=True))
    assert stable(events) == stable(plain)
    status, _ = post(CFG, "/v1/chat/completions", chat_body(tools=[], tool_choice="required"))
    assert status == 200


def test_each_choice_makes_its_own_call() -> None:
    _, (body,) = post(TOOLS_CFG, "/v1/chat/completions", chat_body(tools=[WEATHER], n=2))
    a, b = (c["message"]["tool_calls"][0] for c in body["choices"])
    assert a["function"] == b["function"] and a["id"] != b["id"]
    status, (err,) = post(TOOLS_CFG, "/v1/chat/completions", chat_body(tools=[]))
    assert status == 400 and err["error"]["param"] == "tools"


def test_byte_level_and_reasoning_compose() -> None:
    cfg = replace(TOOLS_CFG, byte_level=True, reasoning=True,
                  model=ModelConfig(think_tokens=10, tool_call_after=4))  # fmt: skip
    _, events = post(cfg, "/v1/chat/completions", chat_body(stream=True, tools=[WEATHER],
                                                            max_tokens=300))  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    kinds = [k for d in deltas for k in ("reasoning", "content", "tool_calls") if d.get(k)]
    first_call = kinds.index("tool_calls")
    assert "reasoning" in kinds[:first_call] and "reasoning" not in kinds[first_call:]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    _, (body,) = post(cfg, "/v1/chat/completions", chat_body(tools=[WEATHER], max_tokens=300))
    msg = body["choices"][0]["message"]
    assert msg["reasoning"] and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert msg["reasoning"] == "".join(d.get("reasoning") or "" for d in deltas)
