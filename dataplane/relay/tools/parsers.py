"""The tool parsers Baton follows, by vLLM's --tool-call-parser name. A backend whose parser
is not here gets no resume for a request that offers tools: refused, explicitly."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dataplane.relay.tools import hermes, llama3_json, mistral, qwen3_xml
from dataplane.relay.tools.parser import ToolParser, Tools

PARSERS: dict[str, Callable[[Tools], ToolParser]] = {
    "hermes": hermes.Hermes,
    "llama3_json": llama3_json.Llama3Json,
    "mistral": mistral.Mistral,
    "qwen3_xml": qwen3_xml.Qwen3Xml,
    "qwen3_coder": qwen3_xml.Qwen3Xml,
}

# Tool parsers whose adjust_request turns skip_special_tokens off whenever it runs (vLLM's
# ParserEngine parsers: the legacy mistral and qwen3_xml), tools offered or not.
_ALWAYS_KEEP = frozenset({"mistral", "qwen3_xml", "qwen3_coder"})


def keeps_special(tool_parser: str, body: Mapping[str, Any], *, reasoning: bool) -> bool:
    """Whether vLLM 0.32 turns skip_special_tokens off for chat request `body` on a backend
    with tool parser `tool_parser` ("" = none) and, when `reasoning`, a reasoning parser.

    vLLM runs the tool parser's adjust_request when the backend has a reasoning parser or
    the request's tool_choice is not "none" (left out: "auto" with tools, else "none"; an
    explicit null is not "none"). hermes's then turns it off only for a request offering
    tools with tool_choice not "none"; mistral's and qwen3_xml's every time; llama3_json's
    never. adjust_request sets the request's field, over the client's own value."""
    if not tool_parser:
        return False
    tools = bool(body.get("tools"))
    choice = body["tool_choice"] if "tool_choice" in body else ("auto" if tools else "none")
    choice_none = choice == "none"
    if choice_none and not reasoning:
        return False  # no tool parser's adjust_request runs
    if tool_parser == "hermes":
        return tools and not choice_none
    return tool_parser in _ALWAYS_KEEP


def parser_for(name: str, tools: Tools) -> ToolParser | None:
    """The parser `name` for a request offering `tools`; None when Baton does not follow it."""
    make = PARSERS.get(name)
    return make(tools) if make is not None else None
