"""A Responses request with tools served as chat (dataplane/responses/convert.py) and its tool
calls written back as Responses events (events.py, translate.py), checked field for field
against vLLM 0.32: vllm/entrypoints/openai/responses/utils.py (construct_input_messages,
_construct_message_from_response_item, construct_tool_dicts), protocol.py
(input_item_parsing, check_tool_usage) and streaming_events.py
(SimpleStreamingEventProcessor, emit_simple_tool_call_*), and the refusals."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import orjson
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from dataplane.responses.events import ResponseEvents, skeleton
from dataplane.responses.request import as_chat, messages_of, replay_refusal
from dataplane.responses.translate import ChatAsResponses
from dataplane.sse import SSEParser, sse

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather.",
     "parameters": CITY, "strict": False},
    {"type": "function", "name": "get_time", "parameters": None},
]  # fmt: skip
BASE = {"model": "m", "store": False, "stream": True, "tools": TOOLS}


def test_function_tools_are_the_chat_tools_vllm_renders() -> None:
    # construct_tool_dicts: ChatCompletionToolsParam(function=FunctionDefinition(the flat
    # tool less its type)).model_dump(): null strict / defer_loading dropped, a null
    # description or parameters the defaults a chat tool leaves out.
    chat = as_chat({**BASE, "input": "hi"})
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                          "parameters": CITY, "strict": False}},
        {"type": "function", "function": {"name": "get_time"}},
    ]  # fmt: skip
    assert chat["tool_choice"] == "auto" and "parallel_tool_calls" not in chat
    assert as_chat({**BASE, "input": "hi", "tool_choice": "none"})["tool_choice"] == "none"
    assert "tools" not in as_chat({**BASE, "tools": [], "input": "hi"})


def test_function_calls_and_outputs_are_vllms_messages() -> None:
    body = {**BASE, "instructions": "be brief", "input": [
        {"role": "user", "content": "weather and time?"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking."}, {"type": "output_text", "text": "!"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city":"Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "thanks"},
    ]}  # fmt: skip
    assert replay_refusal(body) is None
    assert messages_of(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather and time?"},
        # An assistant message is its first part's text; the calls after it join it
        # (tool_calls set, then appended to), as _construct_message_from_response_item does.
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
             "type": "function"},
            {"id": "c2", "function": {"name": "get_time", "arguments": "{}"},
             "type": "function"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "noon", "tool_call_id": "c2"},
        # A call after a tool message opens an assistant message; the text after it fills
        # that message's empty content.
        {"role": "assistant", "tool_calls": [
            {"id": "c3", "function": {"name": "get_time", "arguments": "{}"},
             "type": "function"}], "content": "Done."},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"tool_choice": "required"}, "guided decoding"),
        ({"tool_choice": {"type": "function", "name": "get_weather"}}, "guided decoding"),
        ({"parallel_tool_calls": False}, "guided decoding"),
        ({"tools": [{**TOOLS[0], "strict": True}]}, "strict tool"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "custom tool"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": []}]}, "namespace tool"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "function_call"),
        ({"input": [{"type": "function_call_output", "call_id": "c",
                     "output": [{"type": "input_text", "text": "x"}]}]}, "not text"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": ""}]},
         "custom_tool_call items"),
        ({"input": [{"role": "assistant", "content": "par", "status": "incomplete"}]},
         "in progress"),
        ({"input": "hi", "store": True}, "store: true"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ],
)  # fmt: skip
def test_what_cannot_be_replayed_says_why(extra: dict[str, Any], why: str) -> None:
    reason = replay_refusal({**BASE, "input": "hi", **extra})
    assert reason is not None and why in reason, reason


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"id": "chatcmpl-1", "model": "m", "choices": []}
    if delta is not None:
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        out["usage"] = usage
    return out


def opened(i: int, call_id: str, name: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": i, "id": call_id, "type": "function",
                            "function": {"name": name}}]}  # fmt: skip


def args(i: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}


STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Checking"}), chunk({"content": " both."}),
    chunk(opened(0, "chatcmpl-tool-a", "get_weather")),
    chunk(args(0, '{"city": ')), chunk(args(0, '"Par')), chunk(args(0, 'is"}')),
    chunk(opened(1, "chatcmpl-tool-b", "get_time")),
    chunk(args(1, '{"tz": "UTC"')), chunk(args(1, "}"), finish="tool_calls"),
    chunk(usage={"prompt_tokens": 9, "completion_tokens": 20, "total_tokens": 29}),
]  # fmt: skip


class Sink:
    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data


def events(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The client's events of a chat stream, as the shim writes them."""
    body = {**BASE, "model": "m", "input": "hi"}
    ids = itertools.count()
    ev = ResponseEvents(skeleton(body, "resp_1", 7), lambda prefix: f"{prefix}_{next(ids)}")
    sink = Sink()
    out = ChatAsResponses(sink, ev)

    async def run() -> None:
        for c in stream:
            await out.write(sse(c))
        await out.write(b"data: [DONE]\n\n")

    asyncio.run(run())
    return [orjson.loads(e.data) for e in SSEParser().feed(sink.data)]


def test_tool_calls_are_vllms_function_call_events_in_its_order() -> None:
    got = events(STREAM)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] * 3,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", *["response.function_call_arguments.delta"] * 2,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    added, first, *_ = (e for e in got[9:] if e["type"] != "response.completed")
    strip = {k: v for k, v in added.items() if k != "sequence_number"}
    assert strip == {"type": "response.output_item.added", "output_index": 1, "item": {
        "type": "function_call", "id": "fc_1", "call_id": "chatcmpl-tool-a",
        "name": "get_weather", "arguments": "", "status": "in_progress"}}  # fmt: skip
    assert {k: v for k, v in first.items() if k != "sequence_number"} == {
        "type": "response.function_call_arguments.delta", "output_index": 1, "item_id": "fc_1",
        "delta": '{"city": '}  # fmt: skip
    done, item_done = got[13], got[14]
    assert {k: v for k, v in done.items() if k != "sequence_number"} == {
        "type": "response.function_call_arguments.done", "output_index": 1, "item_id": "fc_1",
        "arguments": '{"city": "Paris"}', "name": "get_weather"}  # fmt: skip
    call_a = {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Paris"}',
              "status": "completed", "id": "fc_1", "call_id": "chatcmpl-tool-a"}  # fmt: skip
    assert item_done["item"] == call_a and item_done["output_index"] == 1
    final = got[-1]["response"]
    assert final["status"] == "completed" and final["tools"] == TOOLS
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][1] == call_a
    assert final["output"][2]["call_id"] == "chatcmpl-tool-b"
    assert final["output"][2]["arguments"] == '{"tz": "UTC"}'


def test_the_openai_sdk_assembles_the_calls() -> None:
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=TOOLS, text_format=omit)  # type: ignore[arg-type]
    final = None
    snapshots: dict[str, str] = {}  # what the SDK assembled from the deltas, per item
    for data in events(STREAM):
        for ev in state.handle_event(construct_type(type_=ResponseStreamEvent, value=data)):  # type: ignore[arg-type]
            if ev.type == "response.function_call_arguments.delta":
                snapshots[ev.item_id] = ev.snapshot
            if ev.type == "response.completed":
                final = ev.response
    assert snapshots == {"fc_1": '{"city": "Paris"}', "fc_2": '{"tz": "UTC"}'}
    assert final is not None
    assert final.output_text == "Checking both."
    calls = [(o.call_id, o.name, o.arguments, o.parsed_arguments)
             for o in final.output if o.type == "function_call"]  # fmt: skip
    assert calls == [
        ("chatcmpl-tool-a", "get_weather", '{"city": "Paris"}', None),
        ("chatcmpl-tool-b", "get_time", '{"tz": "UTC"}', None),
    ]


def test_content_after_a_call_is_a_new_message_item() -> None:
    # vLLM's processor: a delta of another kind closes the open item; a call of another
    # index closes the open call.
    got = events([chunk({"role": "assistant"}), chunk(opened(0, "t1", "f")),
                  chunk(args(0, "{}")), chunk({"content": "after"}, finish="tool_calls"),
                  chunk(usage={"prompt_tokens": 1, "completion_tokens": 3})])  # fmt: skip
    final = got[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["function_call", "message"]
    assert final["output"][1]["content"][0]["text"] == "after"


def test_a_long_answer_is_whole_in_its_done_events() -> None:
    # More deltas than one block of kept text (events._Item.add joins them as they come).
    pieces = [f" w{i}" for i in range(700)]
    stream = [chunk({"role": "assistant", "content": ""}), *(chunk({"content": p}) for p in pieces),
              chunk({"content": "."}, "stop")]  # fmt: skip
    got = events(stream)
    deltas = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
    (done,) = (e for e in got if e["type"] == "response.output_text.done")
    final = got[-1]["response"]["output"][0]["content"][0]["text"]
    assert deltas == done["text"] == final == "".join(pieces) + "."
