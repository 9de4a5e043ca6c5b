"""An agent's turn through Baton on the Messages and Responses APIs, against sims that make
tool calls (`--tool-calls`: vLLM's hermes parser, the sim's default format): a request that
offers tools is served as the chat request vLLM builds from it (dataplane/messages/,
dataplane/responses/), and its client assembles the same calls as from the engine's own
answer. The Messages reference is the sim's own /v1/messages (vLLM's anthropic serving over
its chat server); the sim's /v1/responses runs no tool parser, so the Responses reference is
the sim's chat answer to the same messages, which is what vLLM's Responses serving parses
(the same prompt through one preprocess_chat)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.factories import sdk
from tests.integration.harness import MODEL, Fleet, fleet

pytestmark = pytest.mark.timeout(120)

SIM = ("--tool-calls", "--tool-call-after", "6")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
QUESTION = "what is the weather in Paris?"
TOKENS = 64  # room for the whole call: it ends with EOS well before this


@pytest.fixture(scope="module")
def f(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(tmp_path_factory.mktemp("agent"), n=1, sim_args=SIM) as fl:
        yield fl


def anthropic_client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)


def message(base: str) -> Any:
    """A greedy streamed message with a tool offered, as the SDK assembles it."""
    with anthropic_client(base).messages.stream(
        model=MODEL, max_tokens=TOKENS, messages=[{"role": "user", "content": QUESTION}],
        tools=[{"name": "get_weather", "description": "The weather.", "input_schema": CITY}],  # type: ignore[list-item]
        extra_body={"temperature": 0},
    ) as s:  # fmt: skip
        return s.get_final_message()


def blocks(msg: Any) -> list[dict[str, Any]]:
    """Its content blocks, tool ids left out (each engine draws its own)."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"}
            for b in msg.content]  # fmt: skip


def test_a_messages_tool_use_streams_through_baton_as_the_engine_answers_it(f: Fleet) -> None:
    want = message(f.sims["s0"].ready)
    got = message(f.shim.ready)
    assert want.stop_reason == "tool_use" and any(b.type == "tool_use" for b in want.content)
    assert got.stop_reason == "tool_use" and blocks(got) == blocks(want)
    (call,) = [b for b in got.content if b.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city"}  # type: ignore[arg-type]
    assert call.id.startswith("chatcmpl-tool-")  # the chat stream's call id, as vLLM's


def test_a_messages_turn_with_tool_results_is_served_as_chat(f: Fleet) -> None:
    # The next turn: the call and its result go back; vLLM's conversion of them is what
    # the sim's own /v1/messages renders, so both answer alike.
    first = message(f.sims["s0"].ready)
    (call,) = [b for b in first.content if b.type == "tool_use"]
    turn = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "sunny"}]},
    ]  # fmt: skip

    def answer(base: str) -> Any:
        return anthropic_client(base).messages.create(
            model=MODEL, max_tokens=8, messages=turn, stream=False,  # type: ignore[arg-type]
            tools=[{"name": "get_weather", "input_schema": CITY}],  # type: ignore[list-item]
            tool_choice={"type": "none"}, extra_body={"temperature": 0},
        )  # fmt: skip

    want, got = answer(f.sims["s0"].ready), answer(f.shim.ready)
    assert blocks(got) == blocks(want) and got.usage.input_tokens == want.usage.input_tokens


def test_a_responses_function_call_streams_through_baton_as_chat_parses_it(f: Fleet) -> None:
    chat = sdk(f.sims["s0"].ready + "/v1").chat.completions.create(
        model=MODEL, temperature=0, max_tokens=TOKENS,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
    )  # fmt: skip
    want = [(c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
            for c in chat.choices[0].message.tool_calls or ()]  # fmt: skip
    assert want and chat.choices[0].finish_reason == "tool_calls"
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    with sdk(f.base_url).responses.stream(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=TOKENS, store=False,
        tools=tools,  # type: ignore[arg-type]
    ) as s:  # fmt: skip
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert final.status == "completed"
    calls = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want
    assert all(c.call_id.startswith("chatcmpl-tool-") and c.status == "completed" for c in calls)
    assert kinds.count("response.function_call_arguments.done") == len(calls)
    assert kinds[-1] == "response.completed"
