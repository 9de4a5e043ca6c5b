"""The sim's Anthropic Messages API (/v1/messages, count_tokens), as real processes.

What a client (or a router serving Messages over chat) notices: a Messages request
generates what its chat request (vLLM's conversion) generates, token for token; the
event stream is well formed (message_start, blocks that open, fill and close in
index order, message_delta, message_stop); count_tokens is the chat prompt's length;
reasoning comes as thinking blocks and tool calls as tool_use blocks; a fault cuts a
Messages stream where it cuts the chat stream, and vLLM's error shapes.

Two tests need vLLM 0.32's own environment (`make engines`) and skip without it: the
Anthropic SDK (there, not in this venv) against the sim, and vLLM's converters fed
the sim's chat output, which must give what the sim's /v1/messages gives.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from clients.procs import Part
from tests.engines_cache import vllm_installed
from tests.integration.harness import MODEL, start_sim

VLLM_PY = Path("/root/.cache/baton-engines/vllm-venv/bin/python")
SYSTEM = "Be brief."
QUESTION = "What does a router do?"
MESSAGES = [{"role": "user", "content": QUESTION}]
CHAT_MESSAGES = [{"role": "system", "content": SYSTEM}, *MESSAGES]  # vLLM's conversion of both
TOOLS = [{"name": "get_weather", "input_schema": {"properties": {"city": {"type": "string"}}}}]
TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass
class Stream:
    status: int
    content_type: str
    frames: list[tuple[str | None, Any]] = field(default_factory=list)  # (event, data)
    raw: bytes = b""
    broken: BaseException | None = None

    @property
    def types(self) -> list[str | None]:
        return [e for e, _ in self.frames]

    def deltas(self, kind: str) -> list[str]:
        key = {"text_delta": "text", "thinking_delta": "thinking",
               "input_json_delta": "partial_json"}[kind]  # fmt: skip
        return [d["delta"][key] for e, d in self.frames
                if e == "content_block_delta" and d["delta"]["type"] == kind]  # fmt: skip

    def text(self) -> str:
        return "".join(self.deltas("text_delta"))


def stream(
    part: Part, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
    read_timeout: float | None = None,
) -> Stream:  # fmt: skip
    """A streamed POST, its SSE frames parsed (`data: [DONE]` as (None, "[DONE]"))."""
    async def go() -> Stream:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(part.ready + path, json={"model": MODEL, **body, "stream": True},
                              headers=headers, timeout=aiohttp.ClientTimeout(
                                  total=30, sock_read=read_timeout)) as r:  # fmt: skip
                out = Stream(r.status, r.headers.get("Content-Type", ""))
                try:
                    async for piece in r.content.iter_any():
                        out.raw += piece
                except (TimeoutError, aiohttp.ClientError) as e:
                    out.broken = e
        for frame in out.raw.split(b"\n\n"):
            if frame:
                out.frames.append(_frame(frame))
        return out

    return asyncio.run(go())


def _frame(frame: bytes) -> tuple[str | None, Any]:
    """(event, data); a frame that is not `[event: X\n]data: <json>` is (None, its bytes)."""
    lines = frame.split(b"\n")
    event = lines.pop(0)[7:].decode() if lines[0].startswith(b"event: ") else None
    if len(lines) != 1 or not lines[0].startswith(b"data: "):
        return None, frame
    data = lines[0][6:]
    if data == b"[DONE]":
        return event, "[DONE]"
    try:
        return event, json.loads(data)
    except ValueError:
        return None, frame


def post(
    part: Part, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with s.post(part.ready + path, headers=headers, **kw) as r:
                return r.status, json.loads(await r.read())

    return asyncio.run(go())


def messages_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "system": SYSTEM, "messages": MESSAGES, **extra}


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 16, "messages": CHAT_MESSAGES, **extra}


def assert_well_formed(s: Stream, *, ended: bool = True) -> None:
    """message_start; blocks opened, filled and closed one at a time, indexes 0, 1, ...;
    then (when `ended`) one message_delta and message_stop, last."""
    assert s.types[0] == "message_start"
    assert all(d["type"] == e for e, d in s.frames), "each data names its event"
    body = s.frames[1:-2] if ended else s.frames[1:]
    expect, open_ = 0, None
    for event, data in body:
        if event == "content_block_start":
            assert open_ is None and data["index"] == expect
            open_ = expect
        elif event == "content_block_delta":
            assert data["index"] == open_
        elif event == "content_block_stop":
            assert data["index"] == open_
            open_, expect = None, expect + 1
        else:
            raise AssertionError(f"{event} among the blocks")
    if ended:
        assert open_ is None and s.types[-2:] == ["message_delta", "message_stop"]


@pytest.fixture(scope="module")
def sim() -> Iterator[Part]:
    p = start_sim()
    yield p
    p.stop(grace=3)


@pytest.fixture(scope="module")
def agent() -> Iterator[Part]:
    """A reasoning model that calls tools (the deepseek_r1 and hermes parsers)."""
    p = start_sim("--reasoning", "--tool-calls", "--think-tokens", "6", "--tool-call-after", "4")
    yield p
    p.stop(grace=3)


# -- same tokens as chat ----------------------------------------------------------------------
def test_a_message_is_the_chat_completion_of_its_chat_request(sim: Part) -> None:
    status, msg = post(sim, "/v1/messages", messages_body())
    _, chat = post(sim, "/v1/chat/completions", chat_body())
    assert status == 200
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", msg["id"])  # the chat request's id
    assert (msg["type"], msg["role"]) == ("message", "assistant")
    assert msg["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}]
    assert msg["stop_reason"] == "max_tokens" and "stop_sequence" not in msg  # null: left out
    use = chat["usage"]
    assert msg["usage"] == {"input_tokens": use["prompt_tokens"],
                            "output_tokens": use["completion_tokens"]}  # fmt: skip


def test_a_message_stream_carries_the_chat_streams_text(sim: Part) -> None:
    s = stream(sim, "/v1/messages", messages_body())
    c = stream(sim, "/v1/chat/completions", chat_body())
    assert s.status == 200 and s.broken is None
    assert s.content_type == "text/event-stream; charset=utf-8"
    assert_well_formed(s)
    chat_deltas = [d["choices"][0]["delta"].get("content") for _, d in c.frames[1:-1]]
    assert s.deltas("text_delta") == [t for t in chat_deltas if t]  # one event per chat chunk
    start = s.frames[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    prompt = post(sim, "/v1/chat/completions", chat_body())[1]["usage"]["prompt_tokens"]
    assert start["usage"] == {"input_tokens": prompt, "output_tokens": 0}
    end = s.frames[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"] == {"input_tokens": prompt, "output_tokens": 16}
    assert "[DONE]" not in s.raw.decode()


def test_the_chat_stream_under_a_message_stream_has_usage_on_every_chunk(sim: Part) -> None:
    """stream_options.continuous_usage_stats, as vLLM's chat sends it (message_start's
    usage is the role chunk's)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    c = stream(sim, "/v1/chat/completions", chat_body(max_tokens=3, stream_options=options))
    role, *tokens, final, done = [d for _, d in c.frames]
    n = final["usage"]["prompt_tokens"]
    assert done == "[DONE]" and final["choices"] == []
    assert role["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                             "completion_tokens_details": None}  # fmt: skip
    assert [t["usage"]["completion_tokens"] for t in tokens] == [1, 2, 3]
    assert list(tokens[0]) == ["id", "object", "created", "model", "choices", "usage"]
    plain = stream(sim, "/v1/chat/completions", chat_body(max_tokens=3, stream_options={
        "include_usage": False, "continuous_usage_stats": True}))  # fmt: skip
    assert all("usage" not in d for _, d in plain.frames[:-1])  # only with include_usage


def test_stop_sequences_temperature_and_top_k_map_onto_chat(sim: Part) -> None:
    text = post(sim, "/v1/messages", messages_body())[1]["content"][0]["text"]
    stop = text[5:7]
    sampled = {"temperature": 0.0, "top_p": 0.5, "top_k": 3}
    status, msg = post(sim, "/v1/messages", messages_body(stop_sequences=[stop], **sampled,
                                                          metadata={"user_id": "u1"}))  # fmt: skip
    chat = post(sim, "/v1/chat/completions", chat_body(stop=[stop], **sampled))[1]
    assert status == 200 and msg["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", stop)
    s = stream(sim, "/v1/messages", messages_body(stop_sequences=[stop]))
    assert s.text() == msg["content"][0]["text"]
    assert s.frames[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_count_tokens_is_the_chat_prompts_length(sim: Part) -> None:
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    body = {"model": MODEL, "system": system, "messages": MESSAGES}
    status, counted = post(sim, "/v1/messages/count_tokens", body)
    prompt = post(sim, "/v1/chat/completions", chat_body(max_tokens=1))[1]["usage"]
    n = prompt["prompt_tokens"]
    assert status == 200
    assert counted == {"input_tokens": n, "context_management": {"original_input_tokens": n}}
    used = post(sim, "/v1/messages", {**body, "max_tokens": 1})[1]["usage"]["input_tokens"]
    assert used == n
    # A tool result turns into a tool message (the toy template renders it as a user turn).
    turn = [*MESSAGES, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "rain"}]}]  # fmt: skip
    chat_turn = [*CHAT_MESSAGES[1:], {"role": "assistant"}, {"role": "tool", "content": "rain"}]
    counted = post(sim, "/v1/messages/count_tokens", {"model": MODEL, "messages": turn})[1]
    tokenized = post(sim, "/tokenize", {"model": MODEL, "messages": chat_turn})[1]
    assert counted["input_tokens"] == tokenized["count"]


# -- reasoning and tools ------------------------------------------------------------------------
def test_reasoning_comes_as_a_thinking_block(agent: Part) -> None:
    status, msg = post(agent, "/v1/messages", messages_body(max_tokens=40))
    chat = post(agent, "/v1/chat/completions", chat_body(max_tokens=40))[1]["choices"][0]["message"]
    assert status == 200 and chat["reasoning"]
    thinking, text = msg["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == chat["reasoning"]
    assert re.fullmatch(r"[0-9a-f]{32}", thinking["signature"])
    assert text == {"type": "text", "text": chat["content"]}
    s = stream(agent, "/v1/messages", messages_body(max_tokens=40))
    assert_well_formed(s)
    starts = [d["content_block"] for e, d in s.frames if e == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": ""}, {"type": "text", "text": ""}]
    assert "".join(s.deltas("thinking_delta")) == chat["reasoning"]
    assert s.text() == chat["content"]
    signature = [d for e, d in s.frames if e == "content_block_delta"
                 and d["delta"]["type"] == "signature_delta"]  # fmt: skip
    assert len(signature) == 1 and signature[0]["index"] == 0  # the thinking block's last delta


def test_a_tool_call_is_a_tool_use_block(agent: Part) -> None:
    status, msg = post(agent, "/v1/messages", messages_body(tools=TOOLS, max_tokens=160))
    chat = post(agent, "/v1/chat/completions", chat_body(max_tokens=160, tools=[{
        "type": "function", "function": {"name": "get_weather",
                                         "parameters": TOOLS[0]["input_schema"]}}]))[1]  # fmt: skip
    call = chat["choices"][0]["message"]["tool_calls"][0]
    assert status == 200 and msg["stop_reason"] == "tool_use"
    use = msg["content"][-1]
    assert use["id"].startswith("chatcmpl-tool-")  # the chat call's id (random per request)
    # The values are a function of the prompt, and the two requests render their tools
    # (so their prompts) differently: the same tool and argument, not the same value.
    assert use == {"type": "tool_use", "id": use["id"], "name": "get_weather",
                   "input": use["input"]}  # fmt: skip
    assert use["input"].keys() == json.loads(call["function"]["arguments"]).keys()
    s = stream(agent, "/v1/messages", messages_body(tools=TOOLS, max_tokens=160))
    assert_well_formed(s)
    kinds = [d["content_block"]["type"] for e, d in s.frames if e == "content_block_start"]
    assert kinds[-1] == "tool_use" and kinds[0] == "thinking"
    assert json.loads("".join(s.deltas("input_json_delta"))) == use["input"]
    assert s.frames[-2][1]["delta"]["stop_reason"] == "tool_use"
    # tool_choice "none": no call, as chat with tool_choice "none".
    none = post(agent, "/v1/messages", messages_body(tools=TOOLS, tool_choice={"type": "none"}))
    assert [b["type"] for b in none[1]["content"]] == ["thinking", "text"]


# -- faults: where the chat stream breaks ----------------------------------------------------------
@pytest.mark.parametrize("spec", ["die-after=4", "reset-after=4"])
def test_a_cut_stream_breaks_after_the_same_tokens_as_chat(sim: Part, spec: str) -> None:
    s = stream(sim, "/v1/messages", messages_body(), {"X-Sim-Fault": spec})
    c = stream(sim, "/v1/chat/completions", chat_body(), {"X-Sim-Fault": spec})
    assert s.status == 200 and s.broken is not None and c.broken is not None
    assert_well_formed(s, ended=False)
    assert s.text() == "".join(d["choices"][0]["delta"]["content"] for _, d in c.frames[1:])
    assert len(s.deltas("text_delta")) == 4 and "message_stop" not in s.types
    with pytest.raises(aiohttp.ClientError):  # non-streamed: cut before any answer
        post(sim, "/v1/messages", messages_body(), {"X-Sim-Fault": spec})


def test_an_engine_error_mid_stream_is_vllms_error_event(sim: Part) -> None:
    s = stream(sim, "/v1/messages", messages_body(), {"X-Sim-Fault": "error-after=3"})
    assert s.status == 200 and s.broken is None
    assert s.types == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                       "error"]  # fmt: skip
    err = s.frames[-1][1]["error"]
    assert err["type"] == "internal_error"
    assert err["message"].startswith("2 validation errors for ChatCompletionStreamResponse\n")
    status, body = post(sim, "/v1/messages", messages_body(), {"X-Sim-Fault": "error-after=3"})
    assert (status, body) == (500, {"type": "error", "error": {
        "type": "InternalServerError", "message": "injected fault: engine error"}})  # fmt: skip


def test_an_aborted_stream_ends_with_a_null_stop_reason(sim: Part) -> None:
    s = stream(sim, "/v1/messages", messages_body(), {"X-Sim-Fault": "abort-after=2"})
    assert_well_formed(s)
    assert len(s.deltas("text_delta")) == 2
    assert s.frames[-2][1] == {"type": "message_delta",
                               "delta": {"stop_reason": None, "stop_sequence": None},
                               "usage": {"input_tokens": s.frames[0][1]["message"]["usage"][
                                   "input_tokens"], "output_tokens": 2}}  # fmt: skip


def test_a_stall_holds_the_stream_open(sim: Part) -> None:
    spec = {"X-Sim-Fault": "stall-after=2,stall-seconds=30"}
    s = stream(sim, "/v1/messages", messages_body(), spec, read_timeout=0.5)
    assert isinstance(s.broken, TimeoutError) and len(s.deltas("text_delta")) == 2


def test_status_and_garbage_faults(sim: Part) -> None:
    status, body = post(sim, "/v1/messages", messages_body(), {"X-Sim-Fault": "status=503"})
    assert (status, body) == (503, {"type": "error", "error": {
        "type": "ServiceUnavailableError", "message": "injected fault"}})  # fmt: skip
    s = stream(sim, "/v1/messages", messages_body(), {"X-Sim-Fault": "garbage"})
    assert s.status == 200 and s.frames and all(e is None for e, _ in s.frames)  # not one event


# -- errors ------------------------------------------------------------------------------------
def test_error_shapes(sim: Part) -> None:
    # The pydantic layer answers in the OpenAI shape (vLLM's validation handler)...
    status, body = post(sim, "/v1/messages", {"model": MODEL, "messages": MESSAGES})
    assert status == 400 and body == {"error": {
        "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', 'msg': "
                   "'Field required', 'input': '<dict of 2 items>'}",
        "type": "Bad Request", "param": "body.max_tokens", "code": 400}}  # fmt: skip
    status, body = post(sim, "/v1/messages", b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and body["error"]["param"] == "body.1"
    status, body = post(sim, "/v1/messages", b"{}", {"Content-Type": "text/plain"})
    assert status == 400 and "Unsupported Media Type" in body["error"]["message"]
    # ...the handler in the Anthropic one, with the OpenAI error type.
    status, body = post(sim, "/v1/messages", messages_body(model="nope"))
    assert (status, body) == (404, {"type": "error", "error": {
        "type": "NotFoundError",
        "message": "The model `nope` does not exist. Valid aliases: toy."}})  # fmt: skip
    status, body = post(sim, "/v1/messages", messages_body(max_tokens=10**6))
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    assert body["error"]["message"].startswith("This model's maximum context length is ")
    status, body = post(sim, "/v1/messages/count_tokens", {"model": "nope", "messages": MESSAGES})
    assert status == 404 and body["type"] == "error"


def test_thinking_needs_a_reasoning_model(sim: Part, agent: Part) -> None:
    """vLLM maps thinking.enabled to thinking_token_budget, which a server without a
    reasoning parser refuses once generation starts: a 400, or a stream of one error."""
    body = messages_body(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024})
    status, err = post(sim, "/v1/messages", body)
    assert status == 400 and err["error"]["type"] == "BadRequestError"
    assert err["error"]["message"].startswith("thinking_token_budget is set but reasoning_config")
    s = stream(sim, "/v1/messages", body)
    assert s.status == 200 and s.types == ["error"]
    assert "'code': 400}}" in s.frames[0][1]["error"]["message"]  # the chat error, quoted
    chat = stream(sim, "/v1/chat/completions", chat_body(thinking_token_budget=1024))
    assert chat.frames[0][1]["error"]["code"] == 400 and chat.frames[-1][1] == "[DONE]"
    status, msg = post(agent, "/v1/messages", {**body, "max_tokens": 1100})
    assert status == 200 and msg["content"][0]["type"] == "thinking"
    assert post(sim, "/v1/messages", messages_body(thinking={"type": "disabled"}))[0] == 200


def test_the_engine_key_is_a_bearer_token_only() -> None:
    p = start_sim("--api-key", "k1")
    try:
        ok = post(p, "/v1/messages", messages_body(), {"Authorization": "bearer k1"})
        assert ok[0] == 200
        # An Anthropic client's x-api-key is not read (vLLM's AuthenticationMiddleware).
        refused = post(p, "/v1/messages", messages_body(), {"x-api-key": "k1"})
        assert refused == (401, {"error": "Unauthorized"})
    finally:
        p.stop(grace=3)


# -- against vLLM's own code (its environment, when installed) -----------------------------------
needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="no vLLM venv (make engines)")

SDK_SCRIPT = """
import json, sys
import anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0)
body = json.loads(sys.argv[2])
msg = c.messages.create(**body)
out = {"text": msg.content[0].text, "stop_reason": msg.stop_reason, "usage": msg.usage.input_tokens}
with c.messages.stream(**body) as s:
    out["streamed"] = "".join(s.text_stream)
    out["final"] = s.get_final_message().stop_reason
out["count"] = c.messages.count_tokens(model=body["model"], system=body["system"],
                                       messages=body["messages"]).input_tokens
try:
    c.messages.create(**{**body, "model": "nope"})
except anthropic.NotFoundError as e:
    out["error"] = e.body
print(json.dumps(out))
"""


@needs_vllm
def test_the_anthropic_sdk_reads_the_sim(sim: Part) -> None:
    body = messages_body()
    done = subprocess.run([str(VLLM_PY), "-c", SDK_SCRIPT, sim.ready, json.dumps(body)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    chat = post(sim, "/v1/chat/completions", chat_body())[1]
    assert out["text"] == out["streamed"] == chat["choices"][0]["message"]["content"]
    assert out["stop_reason"] == out["final"] == "max_tokens"
    assert out["usage"] == out["count"] == chat["usage"]["prompt_tokens"]
    assert out["error"] == {"type": "error", "error": {
        "type": "NotFoundError",
        "message": "The model `nope` does not exist. Valid aliases: toy."}}  # fmt: skip


VLLM_SCRIPT = """
import asyncio, json, sys
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as A
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
cases = json.load(open(sys.argv[1]))
async def convert(frames):
    async def gen():
        for f in frames:
            yield f
    return [e async for e in A.message_stream_converter(None, gen())]
out = []
for c in cases:
    chat = A.to_chat_completion_request(AnthropicMessagesRequest.model_validate(c["request"]))
    one = {"chat": chat.model_dump(mode="json", exclude_none=True),
           "events": "".join(asyncio.run(convert(c["frames"])))}
    if c["full"] is not None:
        full = A.messages_full_converter(None, ChatCompletionResponse.model_validate(c["full"]))
        one["message"] = full.model_dump(mode="json", exclude_none=True)
    out.append(one)
print(json.dumps(out))
"""


def _normal(text: str) -> str:
    """Ids and signatures differ from request to request."""
    text = re.sub(r"chatcmpl-[0-9a-f]+", "chatcmpl-ID", text)  # the sim's chat ids are longer
    text = re.sub(r"chatcmpl-tool-[0-9a-f]{16}", "chatcmpl-tool-ID", text)
    return re.sub(r'"signature":\s*"[0-9a-f]{32}"', '"signature":"SIG"', text)


@needs_vllm
def test_vllms_converters_give_what_the_sim_serves(agent: Part, tmp_path: Path) -> None:
    """vLLM's to_chat_completion_request, messages_full_converter and message_stream_converter
    over the sim's chat output give the sim's chat request and /v1/messages answers."""
    from sim.messages_api import chat_body as convert
    from sim.messages_request import check_messages

    requests: list[tuple[dict[str, Any], dict[str, str]]] = [
        (messages_body(max_tokens=40), {}),
        (messages_body(tools=TOOLS, max_tokens=64, stop_sequences=["zz"], top_k=4), {}),
        (messages_body(max_tokens=40, system=[{"type": "text", "text": SYSTEM}], temperature=0,
                       stop_sequences=["foast"]), {}),  # fmt: skip
        (messages_body(max_tokens=40), {"X-Sim-Fault": "error-after=9"}),
        (messages_body(max_tokens=40), {"X-Sim-Fault": "abort-after=9"}),
    ]
    cases, ours = [], []
    for req, fault in requests:
        chat = convert(check_messages({**req, "stream": True}))
        plain = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
        frames = stream(agent, "/v1/chat/completions", chat, fault).raw.split(b"\n\n")
        cases.append({
            "request": {**req, "stream": True},
            "full": None if fault else post(agent, "/v1/chat/completions", plain)[1],
            "frames": [f.decode() + "\n\n" for f in frames if f],
        })  # fmt: skip
        ours.append({"chat": chat, "message": post(agent, "/v1/messages", req)[1],
                     "events": stream(agent, "/v1/messages", req, fault).raw.decode()})  # fmt: skip
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([str(VLLM_PY), "-c", VLLM_SCRIPT, str(tmp_path / "cases.json")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for mine, vllm in zip(ours, theirs, strict=True):
        assert _normal(mine["events"]) == _normal(vllm["events"])
        if "message" in vllm:
            assert json.loads(_normal(json.dumps(mine["message"]))) == json.loads(
                _normal(json.dumps(vllm["message"]))
            )
        # What vLLM's request holds that the sim's chat reads (the rest are its defaults).
        want = {k: v for k, v in vllm["chat"].items() if k in mine["chat"] or k == "messages"}
        assert {k: mine["chat"][k] for k in want} == want
