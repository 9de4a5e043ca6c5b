"""The Anthropic Messages API through real processes (control, a shim, sims that serve it as
vLLM 0.32 does), driven by the official `anthropic` SDK: messages streamed and whole, token
counting, Anthropic's key header and error shapes, a replayable stream that outlives a
SIGKILL of its engine, and a stream that cannot be replayed ending in an explicit error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.factories import sdk
from tests.integration.harness import MODEL, Fleet, fleet, http_full, metric, wait_until

pytestmark = pytest.mark.timeout(120)

# Recent SDKs leave sampling parameters out of create(): they go in the body as given.
GREEDY = {"temperature": 0}
SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
SLOW = ("--decode-ms-per-step", "10")  # time to kill a stream in its middle


def client(f: Fleet, key: str = "unused", **kw: Any) -> anthropic.Anthropic:
    """An Anthropic client on the shim that never retries on its own: a test sees every
    failure."""
    return anthropic.Anthropic(base_url=f.shim.ready, api_key=key, max_retries=0, timeout=60,
                               **kw)  # fmt: skip


def events_of(stream: Any, on_delta: Any = None) -> list[dict[str, Any]]:
    out = []
    deltas = 0
    for ev in stream:
        out.append(ev.model_dump(exclude_none=True))
        if ev.type == "content_block_delta":
            deltas += 1
            if on_delta is not None:
                on_delta(deltas)
    return out


def check_sequence(events: list[dict[str, Any]]) -> str:
    """A valid Messages event sequence of one text block; returns its text."""
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert events[0]["message"]["id"].startswith("chatcmpl-")  # one message, one id
    assert events[0]["message"]["content"] == [] and events[0]["message"]["role"] == "assistant"
    assert {e["index"] for e in events[1:-2]} == {0}
    return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")


def shape(events: list[dict[str, Any]]) -> list[Any]:
    """What two runs of one greedy request share: every event but the message id and the
    thinking signatures (random per block), with a block's deltas merged (a resume may cut
    its text into other pieces)."""
    merged: list[Any] = []
    for e in events:
        if e["type"] == "message_start":
            e = {**e, "message": {**e["message"], "id": "-"}}
        delta = e.get("delta", {})
        if delta.get("type") == "signature_delta":
            e = {**e, "delta": {**delta, "signature": "-"}}
        kind = delta.get("type")
        piece = delta.get("text", delta.get("thinking"))
        last = merged[-1] if merged else None
        if kind in ("text_delta", "thinking_delta") and isinstance(last, list) and last[0] == kind:
            last[1] += piece
        elif kind in ("text_delta", "thinking_delta"):
            merged.append([kind, piece])
        else:
            merged.append(e)
    return merged


def stream(f: Fleet, on_delta: Any = None, **kw: Any) -> list[dict[str, Any]]:
    s = client(f).messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES,  # type: ignore[arg-type]
                                  max_tokens=40, stream=True, extra_body=GREEDY, **kw)  # fmt: skip
    return events_of(s, on_delta)


def failovers(f: Fleet) -> list[dict[str, Any]]:
    return json.loads(f.baton("events", "--kind", "failover", "--json").stdout)


def chat_answer(f: Fleet, max_tokens: int = 40) -> Any:
    return sdk(f.base_url).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "system", "content": SYSTEM}, *MESSAGES],  # type: ignore[list-item]
    )  # fmt: skip


def test_a_message_streamed_and_whole_is_the_chat_answer(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2) as f:
        c = client(f)
        whole = c.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES,  # type: ignore[arg-type]
                                  max_tokens=40, extra_body=GREEDY)  # fmt: skip
        chat = chat_answer(f)
        assert whole.type == "message" and whole.role == "assistant"
        (block,) = whole.content
        assert block.type == "text" and block.text == chat.choices[0].message.content
        assert whole.stop_reason == "max_tokens"
        assert whole.usage.input_tokens == chat.usage.prompt_tokens
        assert whole.usage.output_tokens == 40

        events = stream(f)
        assert check_sequence(events) == block.text
        start, end = events[0]["message"], events[-2]
        assert start["usage"] == {"input_tokens": chat.usage.prompt_tokens, "output_tokens": 0}
        assert end["delta"] == {"stop_reason": "max_tokens"}  # stop_sequence: null
        assert end["usage"] == {"input_tokens": chat.usage.prompt_tokens, "output_tokens": 40}
        # The SDK's own accumulator agrees.
        with c.messages.stream(model=MODEL, system=SYSTEM, messages=MESSAGES,  # type: ignore[arg-type]
                               max_tokens=40, extra_body=GREEDY) as s:  # fmt: skip
            final = s.get_final_message()
        assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
        # A stop sequence ends it the Anthropic way.
        cut = block.text.split()[2]
        stopped = c.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES,  # type: ignore[arg-type]
                                    max_tokens=40, stop_sequences=[cut],
                                    extra_body=GREEDY)  # fmt: skip
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == cut
        # Requests are counted by API.
        assert metric(f.shim.ready, "baton_shim_requests_total",
                      'endpoint="/v1/messages",status="200"') >= 4  # fmt: skip


def test_count_tokens_is_the_prompt_the_message_is_billed(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1) as f:
        c = client(f)
        counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MESSAGES)  # type: ignore[arg-type]
        whole = c.messages.create(model=MODEL, system=SYSTEM, messages=MESSAGES,  # type: ignore[arg-type]
                                  max_tokens=4)  # fmt: skip
        assert counted.input_tokens == whole.usage.input_tokens > 0


def test_anthropic_keys_and_errors(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-team\n")
    with fleet(tmp_path, n=1, shim_args=("--api-keys-file", str(keys))) as f:
        # The SDK sends its key as x-api-key; an auth token as a bearer one.
        assert client(f, "sk-team").messages.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                    max_tokens=2).content  # fmt: skip
        bearer = anthropic.Anthropic(base_url=f.shim.ready, auth_token="sk-team", max_retries=0)
        assert bearer.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens > 0  # type: ignore[arg-type]
        with pytest.raises(anthropic.AuthenticationError) as denied:
            client(f, "sk-wrong").messages.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
        assert denied.value.body == {"type": "error", "error": {
            "type": "authentication_error", "message": denied.value.body["error"]["message"]}}  # type: ignore[index]
        assert "sk-" not in str(denied.value.body)
        ok = client(f, "sk-team", default_headers={"anthropic-beta": "tools-2024-04-04"})
        with pytest.raises(anthropic.NotFoundError) as missing:
            ok.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
        assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError) as bad:
            ok.messages.create(model=MODEL, messages=MESSAGES, max_tokens=0)  # type: ignore[arg-type]
        assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "max_tokens" in bad.value.body["error"]["message"]  # type: ignore[index]
        # An unknown path under the API, and bad JSON, in Anthropic's shape too.
        headers = {"x-api-key": "sk-team", "content-type": "application/json"}
        status, body, _ = http_full("POST", f.shim.ready + "/v1/messages", b"{", headers)
        assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
        status, body, _ = http_full("POST", f.shim.ready + "/v1/messages/batches", b"{}", headers)
        assert status == 404 and json.loads(body)["type"] == "error"


def test_shed_load_is_overloaded_error_which_the_sdk_retries(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1, per_sim=[("--decode-ms-per-step", "50")],
               shim_args=("--max-streams", "1")) as f:  # fmt: skip
        c = client(f)
        busy = c.messages.create(model=MODEL, messages=MESSAGES, max_tokens=40, stream=True)  # type: ignore[arg-type]
        first = next(iter(busy))  # the one slot is taken until this stream ends
        assert first.type == "message_start"
        with pytest.raises(anthropic.APIStatusError) as shed:
            c.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
        assert shed.value.status_code == 529
        assert shed.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert shed.value.response.headers.get("retry-after")
        # With its default retries the SDK waits and gets through once the slot is free.
        patient = anthropic.Anthropic(base_url=f.shim.ready, api_key="unused", max_retries=5)
        assert events_of(busy)[-1]["type"] == "message_stop"
        assert patient.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2).content  # type: ignore[arg-type]


def test_a_replayable_stream_outlives_a_sigkill_of_its_engine(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2, per_sim=[SLOW, SLOW], probe_interval=60) as f:
        want = stream(f)  # uninterrupted
        served: list[str] = []

        def kill_at(n: int) -> None:
            if n == 8:
                (busy,) = [k for k, s in f.sims.items()
                           if metric(s.ready, "vllm:num_requests_running") > 0]  # fmt: skip
                served.append(busy)
                f.sims[busy].kill()

        got = stream(f, on_delta=kill_at)
        assert served and wait_until(lambda: not f.sims[served[0]].alive, 10)
        assert check_sequence(got) == check_sequence(want)
        assert shape(got) == shape(want)  # usage over the whole generation included
        (event,) = failovers(f)
        assert event["from_backend"] == served[0] and event["outcome"] == "resumed"
        assert event["path"] == "token" and event["seam"] == "verified"


THINKING = ("--reasoning", "--think-tokens", "12", *SLOW)


@pytest.mark.parametrize("kill_at_delta", [6, 16])  # in the thinking, and in the answer
def test_thinking_stays_thinking_across_a_sigkill(tmp_path: Path, kill_at_delta: int) -> None:
    with fleet(tmp_path, n=2, sim_args=THINKING, probe_interval=60,
               backend_extra='reasoning_parser = "deepseek_r1"') as f:  # fmt: skip
        want = stream(f)
        kinds = [e["content_block"]["type"] for e in want if e["type"] == "content_block_start"]
        assert kinds == ["thinking", "text"]
        served: list[str] = []

        def kill_at(n: int) -> None:
            if n == kill_at_delta:
                (busy,) = [k for k, s in f.sims.items()
                           if metric(s.ready, "vllm:num_requests_running") > 0]  # fmt: skip
                served.append(busy)
                f.sims[busy].kill()

        got = stream(f, on_delta=kill_at)
        assert served and shape(got) == shape(want)
        (event,) = failovers(f)
        assert event["outcome"] == "resumed" and event["path"] == "token"


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}]
AGENT = ("--reasoning", "--tool-calls", "--think-tokens", "20", "--tool-call-after", "12",
         "--decode-ms-per-step", "20")  # fmt: skip


def test_a_tool_use_stream_cut_ends_in_an_error_event_never_a_silent_cut(
    tmp_path: Path,
) -> None:
    with fleet(tmp_path, n=2, sim_args=AGENT, probe_interval=60) as f:
        served: list[str] = []
        seen: list[str] = []

        def kill_at(n: int) -> None:
            if n == 3:
                (busy,) = [k for k, s in f.sims.items()
                           if metric(s.ready, "vllm:num_requests_running") > 0]  # fmt: skip
                served.append(busy)
                f.sims[busy].kill()

        s = client(f).messages.create(model=MODEL, messages=MESSAGES, max_tokens=64,  # type: ignore[arg-type]
                                      tools=TOOLS, stream=True)  # type: ignore[arg-type]  # fmt: skip
        with pytest.raises(anthropic.APIStatusError) as ended:
            for ev in events_of_iter(s, kill_at):
                seen.append(ev.type)
        assert served and seen[0] == "message_start" and "message_stop" not in seen
        body = ended.value.body
        assert body["type"] == "error" and body["error"]["type"] == "api_error"  # type: ignore[index]
        assert "cannot be resumed" in body["error"]["message"]  # type: ignore[index]
        # Served as chat (dataplane/messages/tools.py): the chat relay's refusal names the
        # tool calls it cannot follow (this backend names no tool_parser).
        assert "tool call" in body["error"]["message"]  # type: ignore[index]
        (event,) = failovers(f)
        assert event["from_backend"] == served[0] and event["outcome"] == "refused"


def events_of_iter(stream: Any, on_delta: Any) -> Any:
    deltas = 0
    for ev in stream:
        yield ev
        if ev.type == "content_block_delta":
            deltas += 1
            on_delta(deltas)
