"""The Messages API's pure parts: vLLM 0.32's pydantic 400s, the Messages -> chat request
conversion, and the chat -> Messages conversions (message and event stream).

Expected values were taken from vLLM 0.32 itself (its FastAPI app with the Anthropic
router and exception handlers; AnthropicServingMessages' converters fed the same chat
chunks), so a change here is a change against vLLM, not a matter of taste.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from sim import messages_events as me
from sim.messages_api import chat_body
from sim.messages_request import check_count, check_messages
from sim.protocol import NO_REASONING_CONFIG, ApiError, Limits, parse_chat
from sim.tokenizer import build_tokenizer

M = [{"role": "user", "content": "hi"}]
BASE = {"model": "m", "messages": M, "max_tokens": 3000}


def sig() -> str:
    return "s" * 32


def rejected(body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ApiError) as e:
        check_messages(body)
    assert e.value.status == 400
    err: dict[str, Any] = e.value.body()["error"]
    return err


# -- the pydantic layer --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "message", "param"),
    [
        ({"max_tokens": None},
         "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', 'msg': 'Field "
         "required', 'input': '<dict of 2 items>'}", "body.max_tokens"),
        ({"max_tokens": 0},
         "1 validation error:\n  {'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value "
         "error, max_tokens must be positive', 'input': '0', 'ctx': {'error': "
         "ValueError('max_tokens must be positive')}}", "body.max_tokens"),
        ({"messages": [{"role": "tool", "content": "hi"}]},
         "1 validation error:\n  {'type': 'literal_error', 'loc': 'body.messages.0.role', 'msg': "
         "\"Input should be 'user', 'assistant' or 'system'\", 'input': 'tool', 'ctx': "
         "{'expected': \"'user', 'assistant' or 'system'\"}}", "body.messages.0.role"),
        ({"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024}},
         "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': 'Value error, "
         "thinking.budget_tokens must be less than max_tokens', 'input': '<dict of 4 items>', "
         "'ctx': {'error': ValueError('thinking.budget_tokens must be less than max_tokens')}}",
         "body"),
        ({"messages": [{"role": "user", "content": None}]},
         "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.messages.0.content', "
         "'msg': 'Input should be a valid string', 'input': 'None'}\n  {'type': 'list_type', "
         "'loc': 'body.messages.0.content', 'msg': 'Input should be a valid list', 'input': "
         "'None'}", "body.messages.0.content"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]},
         "1 validation error:\n  {'type': 'too_long', 'loc': 'body.stop_sequences', 'msg': 'List "
         "should have at most 4 items after validation, not 5', 'input': '<list of 5 items>', "
         "'ctx': {'field_type': 'List', 'max_length': 4, 'actual_length': 5}}",
         "body.stop_sequences"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}},
         "1 validation error:\n  {'type': 'greater_than_equal', 'loc': "
         "'body.thinking.enabled.budget_tokens', 'msg': 'Input should be greater than or equal "
         "to 1024', 'input': '10', 'ctx': {'ge': 1024}}", "body.thinking.enabled.budget_tokens"),
    ],
)  # fmt: skip
def test_bad_bodies_get_vllms_validation_400(
    change: dict[str, Any], message: str, param: str
) -> None:
    body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    assert rejected(body) == {"message": message, "type": "Bad Request", "param": param,
                              "code": 400}  # fmt: skip


def test_a_union_reports_a_branch_only_when_every_branch_fails() -> None:
    change = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}
    ok = [{"role": "system", "content": [change]}]
    check_messages({**BASE, "messages": ok})
    err = rejected({**BASE, "messages": [{**ok[0], "role": "user"}]})
    assert err["message"].startswith(
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body.messages.0', 'msg': 'Value "
        "error, tool_addition blocks are only allowed in messages with role \"system\"'"
    )


def test_lax_coercions_and_ignored_fields() -> None:
    req = check_messages({**BASE, "max_tokens": "7", "stream": "yes", "top_k": 5.0, "n": 4,
                          "return_token_ids": True})  # fmt: skip
    assert req["max_tokens"] == 7 and req["stream"] is True and req["top_k"] == 5
    assert "n" not in req and "return_token_ids" not in req
    assert check_count({"model": "m", "messages": M})["tools"] is None
    with pytest.raises(ApiError):
        check_count({"model": "m"})


# -- Messages -> chat ----------------------------------------------------------------------
def test_the_chat_request_vllm_builds() -> None:
    body = {
        "model": "m", "max_tokens": 2000, "stream": True, "stop_sequences": ["X"],
        "temperature": 0.5, "top_k": 3, "top_p": 0.9, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: 1"},
                   {"type": "text", "text": "Be brief."}, {"type": "text", "text": " Really."}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Hello"},
                {"type": "tool_use", "id": "t1", "name": "get", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "4"},
                                                      {"type": "text", "text": "2"}]},
                                         {"type": "text", "text": "thanks"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2",
                                          "content": "only"}]},
            {"role": "system", "content": "inline"},
        ],
        "tools": [{"name": "get", "input_schema": {"properties": {"q": {"type": "string"}}}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }  # fmt: skip
    chat = chat_body(check_messages(body))
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief. Really."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning": "hmm", "content": "Hello", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "get", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "4\n2"},
        {"role": "user", "content": "thanks"},
        {"role": "tool", "tool_call_id": "t2", "content": "only"},  # its user message: dropped
        {"role": "system", "content": "inline"},
    ]  # fmt: skip
    assert "metadata" not in chat
    assert {k: chat[k] for k in ("max_tokens", "max_completion_tokens", "stop", "temperature",
                                 "top_p", "top_k", "stream", "stream_options", "tool_choice",
                                 "thinking_token_budget")} == {  # fmt: skip
        "max_tokens": 2000, "max_completion_tokens": 2000, "stop": ["X"], "temperature": 0.5,
        "top_p": 0.9, "top_k": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "tool_choice": "auto", "thinking_token_budget": 1024,
    }  # fmt: skip
    assert chat["tools"][0]["function"]["parameters"] == {
        "properties": {"q": {"type": "string"}}, "type": "object"
    }


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        ({"type": "tool", "name": "get"}, {"type": "function", "function": {"name": "get"}}, True),
    ],
)
def test_tool_choice(choice: dict[str, Any], chat_choice: object, parallel: bool) -> None:
    tools = [{"name": "get", "input_schema": {}}]
    chat = chat_body(check_messages({**BASE, "tools": tools, "tool_choice": choice}))
    assert chat["tool_choice"] == chat_choice and chat["parallel_tool_calls"] is parallel
    # Without tools the chat request has neither (vLLM never validates the pair it assigns).
    assert "tool_choice" not in chat_body(check_messages({**BASE, "tool_choice": choice}))


def test_thinking_and_output_config() -> None:
    disabled = chat_body(check_messages({**BASE, "thinking": {"type": "disabled"}}))
    assert disabled["reasoning_effort"] == "low" and "thinking_token_budget" not in disabled
    adaptive = chat_body(check_messages({**BASE, "thinking": {"type": "adaptive"},
                                         "output_config": {"effort": "high"}}))  # fmt: skip
    assert adaptive["reasoning_effort"] == "high"
    count = chat_body(check_count({"model": "m", "messages": M}), count_only=True)
    assert count == {"model": "m", "messages": M}


# -- chat -> Messages ------------------------------------------------------------------------
def chunk(delta: dict[str, Any], finish: str | None = None, stop: str | None = None,
          used: tuple[int, int] | None = None) -> bytes:  # fmt: skip
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop
    c: dict[str, Any] = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1,
                         "model": "toy", "choices": [choice]}  # fmt: skip
    if used is not None:
        c["usage"] = {"prompt_tokens": used[0], "total_tokens": sum(used),
                      "completion_tokens": used[1], "completion_tokens_details": None}  # fmt: skip
    return b"data: " + orjson.dumps(c) + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""}, used=(10, 0))
DONE = b"data: [DONE]\n\n"


def usage_chunk(p: int, c: int) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": "toy",
        "choices": [], "usage": {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c},
    }) + b"\n\n"  # fmt: skip


def events(*frames: bytes, split: bool = False) -> list[tuple[str, dict[str, Any]]]:
    conv = me.StreamConverter(sig)
    raw = b"".join(frames)
    # Split anywhere: a frame cut between writes waits for its end.
    out = b"".join(conv.feed(raw[i : i + 7]) for i in range(0, len(raw), 7)) if split else (
        conv.feed(raw))  # fmt: skip
    parsed = []
    for frame in out.split(b"\n\n")[:-1]:
        head, data = frame.split(b"\n")
        assert head.startswith(b"event: ") and data.startswith(b"data: ")
        body = json.loads(data[6:])
        assert body["type"] == head[7:].decode()
        parsed.append((head[7:].decode(), body))
    return parsed


START = ("message_start", {"type": "message_start", "message": {
    "id": "chatcmpl-abc", "type": "message", "role": "assistant", "content": [], "model": "toy",
    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 0},
}})  # fmt: skip


def test_stream_of_text_exactly_as_vllm() -> None:
    got = events(ROLE, chunk({"content": "He"}, used=(10, 1)), chunk({"content": "llo"}, "length",
                 used=(10, 2)), usage_chunk(10, 2), DONE, split=True)  # fmt: skip
    raw = me.StreamConverter(sig).feed(
        ROLE + chunk({"content": "He"}, "stop", "X", used=(10, 1)) + usage_chunk(10, 1) + DONE
    )
    assert raw.startswith(b'event: message_start\ndata: {"type":"message_start","message":{"id":')
    assert b'{"type":"message_delta","delta":{"stop_reason":"stop_sequence","stop_sequence":"X"}' \
        b',"usage":{"input_tokens":10,"output_tokens":1}}' in raw  # fmt: skip
    assert got == [
        START,
        ("content_block_start", {"type": "content_block_start",
                                 "content_block": {"type": "text", "text": ""}, "index": 0}),
        ("content_block_delta", {"type": "content_block_delta",
                                 "delta": {"type": "text_delta", "text": "He"}, "index": 0}),
        ("content_block_delta", {"type": "content_block_delta",
                                 "delta": {"type": "text_delta", "text": "llo"}, "index": 0}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                           "usage": {"input_tokens": 10, "output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip


def test_thinking_then_text_blocks() -> None:
    got = events(ROLE, chunk({"reasoning": "th"}), chunk({"reasoning": "", "content": "Ans"}),
                 chunk({"content": "wer"}, "stop"), usage_chunk(10, 3), DONE)  # fmt: skip
    assert [(t, d.get("index")) for t, d in got] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert got[1][1]["content_block"] == {"type": "thinking", "thinking": ""}
    assert got[3][1]["delta"] == {"type": "signature_delta", "signature": sig()}
    assert got[9][1]["delta"]["stop_reason"] == "end_turn"


def test_tool_call_block_and_text_held_behind_it() -> None:
    got = events(
        ROLE, chunk({"content": "Let"}),
        chunk({"content": None, "tool_calls": [{"id": "call-1", "type": "function", "index": 0,
                                                "function": {"name": "get"}}]}),
        chunk({"content": "late", "tool_calls": [{"index": 0,
                                                  "function": {"arguments": '{"q": "Ab'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'c"}'}}]}, "tool_calls"),
        usage_chunk(10, 12), DONE,
    )  # fmt: skip
    blocks = [d["content_block"] for t, d in got if t == "content_block_start"]
    assert blocks == [{"type": "text", "text": ""},
                      {"type": "tool_use", "id": "call-1", "name": "get", "input": {}},
                      {"type": "text", "text": ""}]  # fmt: skip
    args = [d["delta"]["partial_json"] for t, d in got if d.get("delta", {}).get("partial_json")]
    assert "".join(args) == '{"q": "Abc"}'
    texts = [d["delta"]["text"] for t, d in got if t == "content_block_delta"
             and d["delta"]["type"] == "text_delta"]  # fmt: skip
    assert texts == ["Let", "late"]
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_in_band_error_ends_the_stream_as_vllms_validation_error() -> None:
    err = (b'data: {"error": {"message": "injected fault: engine error", "type": '
           b'"InternalServerError", "param": null, "code": 500}}\n\n')  # fmt: skip
    got = events(ROLE, chunk({"content": "He"}), err, DONE)
    assert [t for t, _ in got] == ["message_start", "content_block_start", "content_block_delta",
                                   "error"]  # fmt: skip
    line = ("  Field required [type=missing, input_value={'error': {'message': 'in...am': None, "
            "'code': 500}}, input_type=dict]\n    For further information visit "
            "https://errors.pydantic.dev/2.14/v/missing")  # fmt: skip
    assert got[-1][1] == {"type": "error", "error": {"type": "internal_error", "message": (
        f"2 validation errors for ChatCompletionStreamResponse\nmodel\n{line}\nchoices\n{line}"
    )}}  # fmt: skip


def test_abort_and_empty_generations() -> None:
    aborted = events(ROLE, chunk({"content": "He"}), chunk({"content": ""}, "abort"),
                     usage_chunk(10, 1), DONE)  # fmt: skip
    assert aborted[-2][1]["delta"] == {"stop_reason": None, "stop_sequence": None}
    empty = events(ROLE, chunk({}, "stop"), usage_chunk(10, 1), DONE)
    assert [t for t, _ in empty] == ["message_start", "message_delta", "message_stop"]


@pytest.mark.parametrize(
    ("msg", "finish", "stop", "content", "reason"),
    [
        ({"content": "Héllo"}, "length", None, [{"type": "text", "text": "Héllo"}], "max_tokens"),
        ({"content": ""}, "stop", None, [{"type": "text", "text": ""}], "end_turn"),
        ({"content": "He"}, "abort", None, [{"type": "text", "text": "He"}], None),
        ({"content": None, "reasoning": "think"}, "stop", None,
         [{"type": "thinking", "thinking": "think", "signature": "s" * 32}], "end_turn"),
        ({"content": "Let", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get", "arguments": '{"q": "Abc"}'}}]}, "tool_calls", None,
         [{"type": "text", "text": "Let"},
          {"type": "tool_use", "id": "c1", "name": "get", "input": {"q": "Abc"}}], "tool_use"),
    ],
)  # fmt: skip
def test_message_from_a_chat_completion(
    msg: dict[str, Any], finish: str, stop: str | None, content: list[Any], reason: str | None
) -> None:
    chat = {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "toy",
            "choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": [], **msg},
                         "finish_reason": finish, "stop_reason": stop}],
            "usage": {"prompt_tokens": 10, "total_tokens": 14, "completion_tokens": 4}}  # fmt: skip
    want: dict[str, Any] = {"id": "chatcmpl-abc", "type": "message", "role": "assistant",
                            "content": content, "model": "toy"}  # fmt: skip
    if reason is not None:
        want["stop_reason"] = reason
    want["usage"] = {"input_tokens": 10, "output_tokens": 4}
    assert me.message(chat, sig) == want


def test_stop_sequence_in_a_message() -> None:
    chat = {"id": "x", "model": "toy", "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            "choices": [{"message": {"content": "He"}, "finish_reason": "stop",
                         "stop_reason": "X"}]}  # fmt: skip
    body = me.message(chat, sig)
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "X")


# -- what the chat parser makes of what the conversion adds ---------------------------------
LIMITS = Limits(model="m", max_model_len=4096, default_max_tokens=16, default_temperature=0.0)


def test_thinking_budget_needs_a_reasoning_tokenizer() -> None:
    body = chat_body(check_messages({**BASE, "thinking": {"type": "enabled",
                                                          "budget_tokens": 1024}}))  # fmt: skip
    assert parse_chat(body, build_tokenizer(), LIMITS).rejected == NO_REASONING_CONFIG
    assert parse_chat(body, build_tokenizer(reasoning=True), LIMITS).rejected is None
    assert parse_chat({**body, "thinking_token_budget": -1}, build_tokenizer(), LIMITS).rejected \
        is None  # fmt: skip
    with pytest.raises(ApiError):
        parse_chat({**body, "thinking_token_budget": -2}, build_tokenizer(), LIMITS)


def test_a_streamed_message_asks_chat_for_continuous_usage() -> None:
    body = chat_body(check_messages({**BASE, "stream": True}))
    req = parse_chat(body, build_tokenizer(), LIMITS)
    assert req.stream and req.include_usage and req.continuous_usage
    assert not parse_chat(chat_body(check_messages(BASE)), build_tokenizer(), LIMITS).stream
