"""The Messages API's pure parts (dataplane/messages/): a request's conversion to the chat
request vLLM builds from it, whether it can be replayed, the Anthropic events Baton writes
from a chat stream, and Anthropic's error shapes on its paths."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from dataplane.exceptions import ErrorKind, OpenAIError
from dataplane.messages.events import MessageEvents, usage_of
from dataplane.messages.request import as_chat, chat_messages, check_messages, replay_refusal
from dataplane.messages.translate import ChatAsMessages
from dataplane.sse import sse


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_the_chat_messages_are_vllms_conversion() -> None:
    got = chat_messages(body(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                {"type": "text", "text": "You are "}, {"type": "text", "text": ""},
                {"type": "text", "text": "terse."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "one"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                                               "signature": "s"},
                                              {"type": "redacted_thinking", "data": "x"},
                                              {"type": "text", "text": "two"}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": []},
            {"role": "user", "content": [{"type": "text", "text": ""}]},
        ],
    ))  # fmt: skip
    assert got == [
        {"role": "system", "content": "You are terse."},  # joined with no separator
        {"role": "user", "content": "one"},  # one text part: a plain string
        {"role": "assistant", "reasoning": "hm", "content": "two"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant"},  # kept, empty; an empty user message is dropped
    ]


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"tool_choice": {"type": "auto"}}, "tool_choice without tools"),
        ({"output_config": {"effort": "low"}}, "'output_config'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking budget"),
        ({"thinking": {"type": "disabled"}}, "thinking budget"),
        ({"messages": [{"role": "system", "content": "inline"}]}, "inline system"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "image blocks"),
    ],
)  # fmt: skip
def test_what_cannot_be_replayed_says_why(extra: dict[str, Any], why: str) -> None:
    refusal = replay_refusal(body(**extra))
    assert refusal is not None and why in refusal


def test_a_replayable_request_is_the_chat_request_vllm_streams() -> None:
    b = body(stop_sequences=["zz"], temperature=0, top_k=4, top_p=0.5, metadata={"user_id": "u"},
             thinking={"type": "adaptive"}, system="s", stream=True)  # fmt: skip
    assert replay_refusal(b) is None
    assert as_chat(b) == {
        "model": "m", "messages": [{"role": "system", "content": "s"},
                                   {"role": "user", "content": "hi"}],
        "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "stop": ["zz"], "temperature": 0, "top_p": 0.5, "top_k": 4,
    }  # fmt: skip  (metadata is not passed on: vLLM does not read it)


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        ({"system": [{"type": "text", "text": 1}]}, "system[0].text"),
        ({"stop_sequences": "zz"}, "stop_sequences"),
        ({"top_k": 1.5}, "top_k"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_a_bad_request_names_its_parameter(bad: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        check_messages(body(**bad))
    assert err.value.kind is ErrorKind.INVALID_REQUEST and err.value.param == param


def test_count_tokens_needs_no_max_tokens() -> None:
    check_messages({"model": "m", "messages": []}, count_only=True)


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, stop: Any = None,
          usage: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"id": "chatcmpl-1", "model": "m", "choices": []}
    if delta is not None:
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish,
                           "stop_reason": stop}]  # fmt: skip
    if usage is not None:
        out["usage"] = usage
    return out


def frames(out: bytes) -> list[tuple[str, dict[str, Any]]]:
    result = []
    for block in out.decode().split("\n\n")[:-1]:
        kind, data = block.split("\n")
        result.append((kind.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return result


def test_a_chat_stream_becomes_vllms_message_events() -> None:
    ev = MessageEvents(signature=lambda: "SIG")
    out = ev.chunk(chunk({"role": "assistant", "content": ""},
                         usage={"prompt_tokens": 7, "completion_tokens": 0}))  # fmt: skip
    for delta in ({"reasoning": "a"}, {"reasoning": "b"}, {"content": "c"}, {"content": ""}):
        out += ev.chunk(chunk(delta))
    out += ev.chunk(chunk({"content": "d"}, finish="stop", stop="zz"))
    out += ev.chunk(chunk(usage={"prompt_tokens": 7, "completion_tokens": 4}))
    out += ev.done()
    start = {"id": "chatcmpl-1", "type": "message", "role": "assistant", "content": [],
             "model": "m", "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": 7, "output_tokens": 0}}  # fmt: skip
    assert frames(out) == [
        ("message_start", {"type": "message_start", "message": start}),
        ("content_block_start", {"type": "content_block_start", "content_block": {
            "type": "thinking", "thinking": ""}, "index": 0}),
        ("content_block_delta", {"type": "content_block_delta",
                                 "delta": {"type": "thinking_delta", "thinking": "a"}, "index": 0}),
        ("content_block_delta", {"type": "content_block_delta",
                                 "delta": {"type": "thinking_delta", "thinking": "b"}, "index": 0}),
        ("content_block_delta", {"type": "content_block_delta",
                                 "delta": {"type": "signature_delta", "signature": "SIG"},
                                 "index": 0}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start",
                                 "content_block": {"type": "text", "text": ""}, "index": 1}),
        ("content_block_delta", {"type": "content_block_delta",
                                 "delta": {"type": "text_delta", "text": "c"}, "index": 1}),
        ("content_block_delta", {"type": "content_block_delta",
                                 "delta": {"type": "text_delta", "text": "d"}, "index": 1}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "stop_sequence", "stop_sequence": "zz"},
                           "usage": {"input_tokens": 7, "output_tokens": 4}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    # Serialised as vLLM's models are: keys in their field order.
    assert out.split(b"\n\n")[1].startswith(b'event: content_block_start\ndata: {"type":')


@pytest.mark.parametrize(
    ("finish", "stop", "want"),
    [("length", None, ("max_tokens", None)), ("stop", None, ("end_turn", None)),
     ("stop", 2, ("end_turn", None)), ("stop", "x", ("stop_sequence", "x")),
     ("abort", None, (None, None))],
)  # fmt: skip
def test_stop_reasons(finish: str, stop: Any, want: tuple[str | None, str | None]) -> None:
    ev = MessageEvents()
    ev.chunk(chunk({"role": "assistant"}))
    ev.chunk(chunk({"content": "x"}, finish=finish, stop=stop))
    ending = frames(ev.chunk(chunk(usage={"prompt_tokens": 1, "completion_tokens": 1})))
    assert ending[-1][1]["delta"] == {"stop_reason": want[0], "stop_sequence": want[1]}


def test_cached_prompt_tokens_are_given_apart() -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 6}}  # fmt: skip
    assert usage_of(usage) == {"input_tokens": 4, "output_tokens": 2,
                               "cache_read_input_tokens": 6}  # fmt: skip
    assert usage_of(None) == {"input_tokens": 0, "output_tokens": 0}


class Sink:
    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data


def test_the_relays_explicit_end_is_anthropics_error_event_and_nothing_after() -> None:
    sink = Sink()
    out = ChatAsMessages(sink, MessageEvents())
    failed = OpenAIError(ErrorKind.BACKEND_FAILED, "cannot be resumed: why")

    async def run() -> None:
        await out.write(sse(chunk({"role": "assistant", "content": ""})))
        await out.write(sse(chunk({"content": "x"})))
        await out.write(failed.sse())  # the error event, then [DONE]

    asyncio.run(run())
    got = frames(sink.data)
    assert [k for k, _ in got] == ["message_start", "content_block_start", "content_block_delta",
                                   "error"]  # fmt: skip
    error = {"type": "api_error", "message": "cannot be resumed: why"}
    assert got[-1][1] == {"type": "error", "error": error}
    assert out.failed


@pytest.mark.parametrize(
    ("kind", "status", "anthropic"),
    [(ErrorKind.INVALID_REQUEST, 400, "invalid_request_error"),
     (ErrorKind.UNAUTHORIZED, 401, "authentication_error"),
     (ErrorKind.MODEL_NOT_FOUND, 404, "not_found_error"),
     (ErrorKind.TOO_MANY_STREAMS, 529, "overloaded_error"),
     (ErrorKind.BACKEND_FAILED, 500, "api_error")],
)  # fmt: skip
def test_errors_on_the_messages_paths_are_anthropics(
    kind: ErrorKind, status: int, anthropic: str
) -> None:
    err = OpenAIError(kind, "why")
    assert err.for_path("/v1/messages") == (
        status, orjson.dumps({"type": "error", "error": {"type": anthropic, "message": "why"}}))
    assert err.for_path("/v1/messages/count_tokens")[0] == status
    assert err.for_path("/v1/chat/completions") == (err.status, err.json())
    assert err.stream_end("/v1/messages").startswith(b"event: error\ndata: ")
    assert err.stream_end("/v1/completions") == err.sse()
