"""A Responses request's input items and tools as vLLM 0.32 renders them, written as the
chat request that renders the same (vllm/entrypoints/openai/responses/utils.py:
construct_input_messages, _construct_message_from_response_item, construct_tool_dicts;
protocol.py: input_item_parsing, check_tool_usage). Both APIs go through one
preprocess_chat with the same tool parser's adjust_request, so the same messages and tools
give the same prompt and the same tokens. What Baton cannot reproduce raises NotReplayable
with the reason.

Items, in order: a message of the user, system or developer is kept as it is (its text parts
as chat text parts, which vLLM's content parser reads the same: joined with newlines, or
wrapped for an "openai"-format template); an assistant message is its first part's text,
merged into the previous assistant message when that one has no content yet; a
function_call is an assistant tool call, appended to the previous assistant message's calls
when there is one; a function_call_output is a tool message. Refused: reasoning items,
custom and namespaced tool calls, item references, images and files, and a last message
left in progress (vLLM continues it instead of starting a new turn).

Tools: function tools, none strict, with tool_choice auto (vLLM's default) or none, and
parallel calls allowed. Refused: tool_choice required or a named tool, a strict tool, and
parallel_tool_calls false, all of which vLLM serves through guided decoding (a structural
tag) whose state a resume on another engine cannot reproduce; and any other kind of tool
(built-in, MCP, custom, namespace), which chat has no way to offer."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = frozenset({"system", "developer", "user"})
TEXT_PARTS = ("input_text", "output_text")
CONTINUED = ("in_progress", "incomplete")  # a last message vLLM continues


class NotReplayable(Exception):
    """The request's rendering cannot be reproduced exactly as chat; the message says why."""


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """The input items as vLLM's construct_chat_messages_with_tool_call builds them."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        prev = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "function_call":
            call = _call(item)
            if prev is None:
                out.append({"role": "assistant", "tool_calls": [call]})
            else:
                prev.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not (isinstance(output, str) and isinstance(call_id, str)):
                raise NotReplayable("a function_call_output whose output is not text")
            out.append({"role": "tool", "content": output, "tool_call_id": call_id})
        elif kind == "message" and item.get("role") == "assistant":
            text = _assistant_text(item.get("content"))
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                out.append({"role": "assistant", "content": text})
        elif kind == "message" and item.get("role") in ROLES:
            out.append({"role": item["role"], "content": _content(item.get("content"))})
        else:
            raise NotReplayable(f"its input holds {kind} items")
    last = items[-1] if items else {}
    if last.get("type", "message") in ("message", "reasoning") and last.get("status") in CONTINUED:
        raise NotReplayable("its last message is in progress (vLLM continues it)")
    return out


def _call(item: Mapping[str, Any]) -> dict[str, Any]:
    """A function_call item as vLLM's tool call (keys in its order: id, function, type)."""
    name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not all(isinstance(v, str) for v in (name, args, call_id)):
        raise NotReplayable("a function_call without a name, arguments and call_id")
    if item.get("namespace"):
        raise NotReplayable("a namespaced function_call")
    return {"id": call_id, "function": {"name": name, "arguments": args}, "type": "function"}


def _assistant_text(content: Any) -> str:
    """An assistant message's text as vLLM reads it: a string, or its first part's text."""
    if isinstance(content, str):
        return content
    if not (isinstance(content, list) and content and all(_text_part(p) for p in content)):
        raise NotReplayable("an assistant message whose content is not text parts")
    return str(content[0]["text"])


def _content(content: Any) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if not (isinstance(content, list) and all(_text_part(p) for p in content)):
        raise NotReplayable("a message holding parts other than text (images, files)")
    return [{"type": "text", "text": p["text"]} for p in content]


def _text_part(part: Any) -> bool:
    return (isinstance(part, dict) and part.get("type") in TEXT_PARTS
            and isinstance(part.get("text"), str))  # fmt: skip


def chat_tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request's `tools` and `tool_choice`: the function tools vLLM shows the
    template (construct_tool_dicts: each as a chat function, its `type` dropped), and the
    tool_choice it resolves (check_tool_usage: without tools, auto and none are none)."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise NotReplayable(f"tool_choice {choice!r} is served by guided decoding (or refused "
                            "by vLLM), whose state a resume on another engine cannot "
                            "reproduce")  # fmt: skip
    if not tools:
        return {}
    if not isinstance(tools, list):
        raise NotReplayable("its tools are not a list")
    if body.get("parallel_tool_calls") is False:
        raise NotReplayable("parallel_tool_calls false makes vLLM constrain the call by "
                            "guided decoding, which a resume cannot reproduce")  # fmt: skip
    return {"tools": [_tool(t) for t in tools], "tool_choice": choice}


def _tool(tool: Any) -> dict[str, Any]:
    """A flat Responses function tool as chat's (vLLM's FunctionDefinition keeps name,
    description, parameters, strict and defer_loading, a null strict or defer_loading
    dropped: leaving out what is null is the same tool)."""
    if not (isinstance(tool, dict) and tool.get("type") == "function"
            and isinstance(tool.get("name"), str)):  # fmt: skip
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise NotReplayable(f"a {kind} tool (only function tools are replayed)")
    if tool.get("strict"):
        raise NotReplayable("a strict tool is served by guided decoding of its arguments, "
                            "which a resume cannot reproduce")  # fmt: skip
    function = {"name": tool["name"]}
    for name in ("description", "parameters", "strict", "defer_loading"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    return {"type": "function", "function": function}
