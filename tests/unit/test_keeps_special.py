"""Whether the engine's parsers turn skip_special_tokens off for a chat request (vLLM 0.32's
adjust_request, dataplane.relay.tools.parsers.keeps_special), and what the stitcher makes
of it: the think tags as the stream shows them and the resume's decoding."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from dataplane.relay.resume.reasoning import Markers
from dataplane.relay.stitch import Stitcher
from dataplane.relay.tools.parsers import keeps_special
from dataplane.request import ClientRequest, Endpoint
from sim.adjust import keeps_special as sim_keeps_special
from sim.protocol import tool_choice

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
NO_CHOICE = object()  # tool_choice left out of the body


def body(tools: bool, choice: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if tools:
        out["tools"] = TOOLS
    if choice is not NO_CHOICE:
        out["tool_choice"] = choice
    return out


@pytest.mark.parametrize(
    ("parser", "reasoning", "tools", "choice", "want"),
    [
        # qwen3_xml and mistral: every time adjust_request runs, tools or not.
        ("qwen3_xml", True, False, NO_CHOICE, True),  # a reasoning parser runs it
        ("qwen3_coder", True, False, NO_CHOICE, True),
        ("mistral", True, False, NO_CHOICE, True),
        ("qwen3_xml", False, False, NO_CHOICE, False),  # "none": nothing runs it
        ("qwen3_xml", False, False, None, True),  # an explicit null is not "none"
        ("mistral", False, False, None, True),
        ("qwen3_xml", False, True, "none", False),
        ("qwen3_xml", True, True, "none", True),
        # hermes: only with tools and tool_choice other than "none".
        ("hermes", True, False, NO_CHOICE, False),
        ("hermes", False, True, NO_CHOICE, True),
        ("hermes", False, True, None, True),
        ("hermes", False, True, "required", True),
        ("hermes", True, True, "none", False),
        # llama3_json never; no tool parser: nothing runs.
        ("llama3_json", True, True, "auto", False),
        ("", True, True, "auto", False),
    ],
)
def test_the_rule_follows_vllms_adjust_request(
    parser: str, reasoning: bool, tools: bool, choice: Any, want: bool
) -> None:
    assert keeps_special(parser, body(tools, choice), reasoning=reasoning) is want


CHOICES = (NO_CHOICE, None, "auto", "none", "required")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "qwen3_xml", ""])
def test_the_rule_agrees_with_the_sims_engine_everywhere(parser: str) -> None:
    for reasoning, tools, choice in itertools.product((False, True), (False, True), CHOICES):
        b = body(tools, choice)
        sim = sim_keeps_special(
            parser or None, reasoning=reasoning, tools=tools,
            tool_choice_none=tool_choice(b) == "none",
        )  # fmt: skip
        assert keeps_special(parser, b, reasoning=reasoning) is sim, (reasoning, tools, choice)


MARKERS = Markers(start_id=1, end_id=2, start_text="<think>", end_text="</think>", special=True)


@pytest.mark.parametrize("client_skip", [None, True])
def test_a_chat_without_tools_shows_the_special_end_tag_on_qwen3_xml_with_reasoning(
    client_skip: bool | None,
) -> None:
    b = body(False, NO_CHOICE)
    if client_skip is not None:
        b["skip_special_tokens"] = client_skip  # adjust_request overrides the client's value
    s = Stitcher(ClientRequest(Endpoint.CHAT, b, "m", True, True), strip_ids=True)
    s.follow_tools("qwen3_xml", lambda: "id", reasoning=True)
    s.follow_reasoning("deepseek_r1", MARKERS)
    assert s.markers is not None and s.markers.end_text == "</think>"
    assert not s.markers.skipped
    assert s.resume_fields == {"skip_special_tokens": False}
    assert not any(p.unfollowed for p in s.choices.values())


def test_without_a_reasoning_parser_the_tag_stays_hidden() -> None:
    s = Stitcher(
        ClientRequest(Endpoint.CHAT, body(False, NO_CHOICE), "m", True, True), strip_ids=True
    )
    s.follow_tools("qwen3_xml", lambda: "id", reasoning=False)
    s.follow_reasoning("deepseek_r1", MARKERS)
    assert s.markers is not None and s.markers.skipped == {1, 2}
    assert s.resume_fields == {}
