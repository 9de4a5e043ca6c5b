"""A Responses request read as vLLM reads it, whether it can be replayed on another engine,
and the events the shim writes for one it serves as chat (dataplane/responses/)."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from dataplane.exceptions import OpenAIError
from dataplane.responses.events import ResponseEvents, skeleton
from dataplane.responses.request import as_chat, check_responses, messages_of, replay_refusal
from dataplane.sse import SSEParser

BASE = {"model": "m", "input": "hi", "store": False}


def test_input_renders_as_the_chat_messages_vllm_builds() -> None:
    body = {**BASE, "instructions": "be brief", "input": [
        {"role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "c"},
                                     {"type": "input_text", "text": "d"}]},
    ]}  # fmt: skip
    assert messages_of(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        # vLLM keeps a user message's parts; its content parser joins them with newlines
        # (or keeps them apart, for an "openai"-format template), as chat's does.
        {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]},
    ]
    chat = as_chat({**body, "max_output_tokens": 7, "temperature": 0, "seed": 3})
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0 and chat["seed"] == 3
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "input" not in chat and "store" not in chat


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"store": True}, "store: true"),
        ({"store": None}, "store: true"),  # vLLM's default is to store
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "web_search tool"),
        (
            {"tool_choice": "required", "tools": [{"type": "function", "name": "f"}]},
            "guided decoding",
        ),
        ({"reasoning": {"effort": "low"}}, "'reasoning'"),
        ({"top_logprobs": 2}, "'top_logprobs'"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning items"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "other than text",
        ),
    ],
)
def test_what_cannot_be_replayed_says_why(extra: dict[str, Any], why: str) -> None:
    body = {**BASE, **extra}
    if extra.get("store", False) is None:
        del body["store"]
    reason = replay_refusal(body)
    assert reason is not None and why in reason


def test_a_plain_store_false_request_can_be_replayed() -> None:
    assert replay_refusal(BASE) is None
    assert replay_refusal({**BASE, "text": {"format": {"type": "text"}}}) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": ["x"]}, "input"),
        ({"model": "m", "input": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "input": "x", "previous_response_id": ""}, "previous_response_id"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "x", "instructions": 3}, "instructions"),
    ],
)
def test_bad_requests_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        check_responses(body)
    assert err.value.param == param and err.value.status == 400


def events(stream: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(e.data) for e in SSEParser().feed(stream)]


def writer() -> ResponseEvents:
    ids = itertools.count()
    return ResponseEvents(skeleton({**BASE, "max_output_tokens": 5}, "resp_1", 100),
                          lambda p: f"{p}_{next(ids)}")  # fmt: skip


def test_events_in_vllms_order_with_one_item_across_any_number_of_deltas() -> None:
    w = writer()
    out = w.start() + w.delta("message", "he") + w.delta("message", "llo")
    out += w.completed("length", {"prompt_tokens": 3, "completion_tokens": 5})
    got = events(out)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert {e["item_id"] for e in got if "item_id" in e} == {"msg_0"}
    final = got[-1]["response"]
    assert final["id"] == "resp_1" and final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "hello"
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["total_tokens"] == 8
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []


def test_reasoning_then_text_are_two_items_and_a_failure_keeps_what_was_sent() -> None:
    w = writer()
    out = w.start() + w.delta("reasoning", "think") + w.delta("message", "ok") + w.failed("gone")
    got = events(out)
    added = [e["item"]["type"] for e in got if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [e["output_index"] for e in got if e["type"] == "response.output_item.done"] == [0, 1]
    final = got[-1]
    assert final["type"] == "response.failed" and final["response"]["status"] == "failed"
    assert final["response"]["error"] == {"code": "server_error", "message": "gone"}
    assert final["response"]["output"][1]["content"][0]["text"] == "ok"
