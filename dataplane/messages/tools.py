"""A Messages request's tools, as vLLM 0.32 converts them into its chat request
(vllm/entrypoints/anthropic/serving.py: _convert_tools, _convert_tool_choice,
_convert_tool_use_block, _convert_tool_result_block, _convert_user_tool_result), and what
of them Baton cannot replay: each refusal raises NotReplayable with the reason.

Replayed: function tools (none strict) offered with tool_choice auto (vLLM's default when
tools are given) or none; tool_use blocks with an id; tool_result blocks of text. Refused:
what vLLM serves through guided decoding (tool_choice any or tool, a strict tool,
disable_parallel_tool_use: vLLM constrains the call envelope to allow one call), whose
grammar state a resume on another engine cannot reproduce; and what vLLM converts in a way
Baton cannot write exactly (a tool_use without an id gets "call_<unix time>", images and
tool references inside a result, an assistant's non-text result, which vLLM writes as a
Python repr)."""

# baton: pure

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

CHOICES = {"auto": "auto", "none": "none"}  # Anthropic's tool_choice type -> chat's
GUIDED = ("any", "tool")  # vLLM: "required" / a named function, served by guided decoding


class NotReplayable(Exception):
    """The request's conversion cannot be reproduced exactly; the message says why."""


def chat_tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request's `tools`, `tool_choice` and `parallel_tool_calls`, as vLLM sets them
    (a tool_choice without tools: vLLM assigns it after validating, which a chat request
    sent to it cannot do, so it is refused)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return {}
    if not (isinstance(tools, list) and tools):
        raise NotReplayable("a tool_choice without tools, or an empty tools list")
    out: dict[str, Any] = {"tools": [_tool(t) for t in tools], "tool_choice": "auto"}
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (*CHOICES, *GUIDED):
            raise NotReplayable("its tool_choice is not one vLLM reads")
        if choice["type"] in GUIDED:
            raise NotReplayable(
                f"tool_choice {choice['type']!r} is served by guided decoding, whose state "
                "a resume on another engine cannot reproduce"
            )
        if choice.get("disable_parallel_tool_use"):
            raise NotReplayable("disable_parallel_tool_use makes vLLM constrain the call "
                                "by guided decoding, which a resume cannot reproduce")  # fmt: skip
        out["tool_choice"] = CHOICES[choice["type"]]
        out["parallel_tool_calls"] = True  # vLLM: not disable_parallel_tool_use
    return out


def _tool(tool: Any) -> dict[str, Any]:
    """One Anthropic tool as vLLM's chat function tool. vLLM's FunctionDefinition drops a
    null `strict` or `defer_loading` when it renders the tool, so leaving them out is the
    same tool."""
    if not (isinstance(tool, dict) and isinstance(tool.get("name"), str)
            and isinstance(tool.get("input_schema"), dict)):  # fmt: skip
        raise NotReplayable("a tool without a name and an input_schema object")
    if tool.get("strict"):
        raise NotReplayable("a strict tool is served by guided decoding of its arguments, "
                            "which a resume cannot reproduce")  # fmt: skip
    function: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool["input_schema"]
    for name in ("strict", "defer_loading"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    return {"type": "function", "function": function}


def tool_call(block: Mapping[str, Any]) -> dict[str, Any]:
    """A tool_use block as vLLM's assistant tool call: arguments are Python's json.dumps of
    the input (", " and ": " separators, ASCII escapes), as vLLM serialises it."""
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not (isinstance(call_id, str) and call_id):
        raise NotReplayable("a tool_use block without an id (vLLM invents one from the time)")
    if not (name is None or isinstance(name, str)) or not (args is None or isinstance(args, dict)):
        raise NotReplayable("a tool_use block whose name or input vLLM would not accept")
    return {"id": call_id, "type": "function",
            "function": {"name": name or "", "arguments": json.dumps(args or {})}}  # fmt: skip


def tool_messages(block: Mapping[str, Any]) -> dict[str, Any]:
    """A user's tool_result block as vLLM's tool message: its text items joined with
    newlines (items that are not text are skipped, as vLLM skips them; images and tool
    references, which vLLM turns into messages of their own, are refused)."""
    call_id, content = block.get("tool_use_id"), block.get("content")
    if not (call_id is None or isinstance(call_id, str)):
        raise NotReplayable("a tool_result whose tool_use_id is not a string")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        texts = []
        for item in content:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind is None or kind in ("image", "tool_reference"):
                raise NotReplayable("a tool_result holding images, tool references or items "
                                    "that are not objects")  # fmt: skip
            if kind == "text":
                if not isinstance(item.get("text", ""), str):
                    raise NotReplayable("a tool_result text item without text")
                texts.append(item.get("text", ""))
        text = "\n".join(texts)
    else:
        raise NotReplayable("a tool_result whose content is neither text nor items")
    return {"role": "tool", "tool_call_id": call_id or "", "content": text}


def assistant_result(block: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant's tool_result block as vLLM writes it: a text part (of a string
    content only: vLLM writes any other as its Python repr)."""
    content = block.get("content")
    if not (content is None or isinstance(content, str)):
        raise NotReplayable("an assistant tool_result whose content is not a string")
    return {"type": "text", "text": f"Tool result: {content or ''}"}
