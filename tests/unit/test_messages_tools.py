"""A Messages request with tools served as chat (dataplane/messages/tools.py, request.py) and
its tool calls written back as Anthropic events (events.py), checked field for field against
what vLLM 0.32 does in vllm/entrypoints/anthropic/serving.py (to_chat_completion_request:
_convert_tools, _convert_tool_choice, _convert_tool_use_block, _convert_user_tool_result;
message_stream_converter for the events), and the refusals."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from anthropic._models import construct_type
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent

from dataplane.messages.events import MessageEvents
from dataplane.messages.request import as_chat, chat_messages, replay_refusal

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"name": "get_weather", "description": "The weather.", "input_schema": CITY},
    {"name": "get_time", "input_schema": {"type": "object"}, "defer_loading": True},
]


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": "hi"}], **kw}  # fmt: skip


def test_tools_and_tool_choice_are_vllms_chat_tools() -> None:
    # _convert_tools: {"type": "function", "function": {name, description, parameters:
    # input_schema, strict, defer_loading}}; FunctionDefinition drops a null strict or
    # defer_loading (and a missing description is its null default), so they are left out.
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                          "parameters": CITY}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"},
                                          "defer_loading": True}},
    ]  # fmt: skip
    chat = as_chat(body(tools=TOOLS))
    assert replay_refusal(body(tools=TOOLS)) is None
    # No tool_choice: vLLM's _convert_tools sets "auto" and leaves parallel_tool_calls alone.
    assert chat["tools"] == tools and chat["tool_choice"] == "auto"
    assert "parallel_tool_calls" not in chat
    for given, want in (("auto", "auto"), ("none", "none")):
        chat = as_chat(body(tools=TOOLS, tool_choice={"type": given}))
        # _convert_tool_choice: parallel_tool_calls = not disable_parallel_tool_use.
        assert chat["tool_choice"] == want and chat["parallel_tool_calls"] is True
    chat = as_chat(body(tools=TOOLS, tool_choice={"type": "auto",
                                                  "disable_parallel_tool_use": False}))  # fmt: skip
    assert chat["parallel_tool_calls"] is True


def test_tool_use_and_tool_result_blocks_are_vllms_messages_in_its_order() -> None:
    inp = {"city": "Zürich", "n": [1, 2.5, None, True], "o": {"b": 1, "a": 2}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": inp},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True, "content": [
                {"type": "text", "text": "noon"}, {"type": "document", "x": 1},
                {"type": "text", "text": "UTC"}]},
            {"type": "text", "text": "and tomorrow?"},
        ]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_3", "name": "get_weather"},
            {"type": "tool_result", "tool_use_id": "x", "content": "odd"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
    ]  # fmt: skip
    got = chat_messages(body(messages=messages, tools=TOOLS))
    assert got == [
        {"role": "user", "content": "weather?"},
        # Keys as _convert_message_content sets them: reasoning, tool_calls, content.
        {"role": "assistant", "reasoning": "hm", "tool_calls": [
            # arguments: Python's json.dumps (", ", ": ", ASCII escapes, input's key order).
            {"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(inp)}},
            {"id": "toolu_2", "type": "function", "function": {
                "name": "get_time", "arguments": "{}"}},
        ], "content": "Let me look."},
        # A user's tool results go out as tool messages first, as the blocks come; text
        # items joined with newlines, other items skipped; then the user's own text.
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "noon\nUTC"},
        {"role": "user", "content": "and tomorrow?"},
        # No input: "{}"; an assistant's tool_result: a "Tool result: " text part.
        {"role": "assistant", "tool_calls": [{"id": "toolu_3", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}], "content": "Tool result: odd"},
        # A user message of tool results only is dropped; its tool message stays.
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
    ]  # fmt: skip
    assert '"Z\\u00fcrich"' in got[1]["tool_calls"][0]["function"]["arguments"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"tool_choice": {"type": "any"}}, "guided decoding"),
        ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "guided decoding"),
        ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "guided"),
        ({"tools": [{**TOOLS[0], "strict": True}]}, "strict tool"),
        ({"tools": []}, "empty tools list"),
        ({"tools": None, "tool_choice": {"type": "none"}}, "tool_choice without tools"),
        ({"messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "name": "f", "input": {}}]}]}, "without an id"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
            "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]}]},
         "images"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
            "content": [{"type": "tool_reference", "tool_name": "f"}]}]}]}, "tool references"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result",
            "tool_use_id": "t", "content": [{"type": "text", "text": "x"}]}]}]}, "assistant"),
    ],
)  # fmt: skip
def test_what_cannot_be_replayed_says_why(extra: dict[str, Any], why: str) -> None:
    b = body(**{"tools": TOOLS, **extra})
    if b["tools"] is None:
        del b["tools"]
    refusal = replay_refusal(b)
    assert refusal is not None and why in refusal, refusal


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"id": "chatcmpl-1", "model": "m", "choices": []}
    if delta is not None:
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish,
                           "stop_reason": None}]  # fmt: skip
    if usage is not None:
        out["usage"] = usage
    return out


def opened(i: int, call_id: str, name: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": i, "id": call_id, "type": "function",
                            "function": {"name": name}}]}  # fmt: skip


def args(i: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}


# A chat stream as vLLM's hermes parser streams it: content, then two calls one after the
# other, each's arguments in pieces, finish_reason tool_calls, the usage chunk.
STREAM = [
    chunk({"role": "assistant", "content": ""}, usage={"prompt_tokens": 9, "completion_tokens": 0}),
    chunk({"content": "Checking"}), chunk({"content": " both."}),
    chunk(opened(0, "chatcmpl-tool-a", "get_weather")),
    chunk(args(0, '{"city": ')), chunk(args(0, '"Par')), chunk(args(0, 'is"}')),
    chunk(opened(1, "chatcmpl-tool-b", "get_time")),
    chunk(args(1, '{"tz": "UTC"')), chunk(args(1, "}"), finish="tool_calls"),
    chunk(usage={"prompt_tokens": 9, "completion_tokens": 20}),
]  # fmt: skip


def frames(out: bytes) -> list[tuple[str, dict[str, Any]]]:
    result = []
    for block in out.decode().split("\n\n")[:-1]:
        kind, data = block.split("\n")
        result.append((kind.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return result


def events(stream: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    ev = MessageEvents(signature=lambda: "SIG")
    out = b"".join(ev.chunk(c) for c in stream) + ev.done()
    return frames(out)


def delta(i: int, d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("content_block_delta", {"type": "content_block_delta", "delta": d, "index": i})


def json_delta(i: int, piece: str) -> tuple[str, dict[str, Any]]:
    return delta(i, {"type": "input_json_delta", "partial_json": piece})


def start(i: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("content_block_start", {"type": "content_block_start", "content_block": block,
                                    "index": i})  # fmt: skip


def stop(i: int) -> tuple[str, dict[str, Any]]:
    return ("content_block_stop", {"type": "content_block_stop", "index": i})


def test_tool_calls_are_vllms_tool_use_events_in_its_order() -> None:
    got = events(STREAM)
    assert [k for k, _ in got[:1]] == ["message_start"]
    assert got[1:] == [
        start(0, {"type": "text", "text": ""}),
        delta(0, {"type": "text_delta", "text": "Checking"}),
        delta(0, {"type": "text_delta", "text": " both."}),
        stop(0),
        start(1, {"type": "tool_use", "id": "chatcmpl-tool-a", "name": "get_weather",
                  "input": {}}),
        json_delta(1, '{"city": '), json_delta(1, '"Par'), json_delta(1, 'is"}'),
        stop(1),
        start(2, {"type": "tool_use", "id": "chatcmpl-tool-b", "name": "get_time", "input": {}}),
        json_delta(2, '{"tz": "UTC"'), json_delta(2, "}"),
        stop(2),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 9, "output_tokens": 20}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip


def test_the_anthropic_sdk_assembles_the_calls() -> None:
    snapshot = None
    bufs: dict[int, bytes] = {}
    for _, data in events(STREAM):
        ev = construct_type(type_=RawMessageStreamEvent, value=data)
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    assert snapshot is not None and snapshot.stop_reason == "tool_use"
    blocks = [b.model_dump(exclude_none=True) for b in snapshot.content]
    assert blocks == [
        {"type": "text", "text": "Checking both."},
        {"type": "tool_use", "id": "chatcmpl-tool-a", "name": "get_weather",
         "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "chatcmpl-tool-b", "name": "get_time", "input": {"tz": "UTC"}},
    ]  # fmt: skip


def test_text_after_a_call_is_held_until_the_call_closes_and_thinking_closes_it() -> None:
    # vLLM's converter: content while a tool_use block is open is pending, flushed as a
    # text block of its own when the block stops; a stop string after complete calls is
    # still tool_use (tool_complete wins).
    stream = [
        chunk({"role": "assistant"}),
        chunk(opened(0, "t1", "f")), chunk(args(0, "{}")),
        chunk({"content": "a"}), chunk({"content": "b"}),
        chunk({"reasoning": "r"}),
        chunk({"content": "c"}, finish="stop"),
        chunk(usage={"prompt_tokens": 1, "completion_tokens": 5}),
    ]  # fmt: skip
    stream[-2]["choices"][0]["stop_reason"] = "STOP"
    got = events(stream)[1:]
    assert got == [
        start(0, {"type": "tool_use", "id": "t1", "name": "f", "input": {}}),
        json_delta(0, "{}"), stop(0),
        start(1, {"type": "text", "text": ""}), delta(1, {"type": "text_delta", "text": "ab"}),
        stop(1),
        start(2, {"type": "thinking", "thinking": ""}),
        delta(2, {"type": "thinking_delta", "thinking": "r"}),
        delta(2, {"type": "signature_delta", "signature": "SIG"}), stop(2),
        start(3, {"type": "text", "text": ""}), delta(3, {"type": "text_delta", "text": "c"}),
        stop(3),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"input_tokens": 1, "output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip


def test_a_call_a_stop_string_cut_short_is_a_stop_sequence() -> None:
    stream = [chunk({"role": "assistant"}), chunk(opened(0, "t1", "f")),
              chunk(args(0, '{"a": '), finish="stop"),
              chunk(usage={"prompt_tokens": 1, "completion_tokens": 2})]  # fmt: skip
    stream[2]["choices"][0]["stop_reason"] = "zz"
    ending = events(stream)[-2][1]
    assert ending["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "zz"}
