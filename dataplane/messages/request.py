"""A Messages API request, read the way vLLM 0.32 reads it (vllm/entrypoints/anthropic/
serving.py): what a router must trust, and whether the request can be replayed faithfully
on another engine (`as_chat`).

vLLM serves /v1/messages by converting the request into a chat completion request and its
chat stream back into Anthropic events. A request whose conversion Baton can reproduce
exactly (text, thinking, tool_use and tool_result blocks, tools offered with tool_choice
auto or none, no images, no inline system messages, no constrained output or thinking
budget) is the chat request `as_chat` returns: the same
messages through the same template on the same engine generate the same tokens, and a chat
stream carries the token ids a token-exact resume needs, which a Messages stream does not."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dataplane.exceptions import bad_request
from dataplane.messages import tools
from dataplane.messages.tools import NotReplayable
from dataplane.request import is_int, is_number

ROLES = frozenset({"user", "assistant", "system"})
# Blocks whose conversion Baton reproduces: text (a text part), thinking (the message's
# `reasoning`), redacted_thinking and a message's own tool_reference (dropped, as vLLM drops
# them), tool_use and tool_result (dataplane/messages/tools.py). Not images (the engine's
# media fetch and processor), nor tool_addition/tool_removal (they change the tools).
REPLAYED_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_reference",
                             "tool_use", "tool_result"})  # fmt: skip
# Copied to the chat request unchanged, as vLLM's conversion copies them.
COPIED = ("temperature", "top_p", "top_k", "cache_salt", "chat_template_kwargs")
# Parameters that change what the engine does beyond the messages in ways a resume cannot
# reproduce (constrained output, a thinking budget or effort, disaggregated serving; tools
# are replayed or refused by dataplane/messages/tools.py):
# such a request is relayed as the engine streams it, and not resumed.
NOT_REPLAYABLE = ("output_config", "kv_transfer_params",
                  "ec_transfer_params", "vllm_xargs", "watermarking")  # fmt: skip
# Claude Code's per-request attribution header, which vLLM drops from the system prompt.
BILLING = "x-anthropic-billing-header"


def _check_blocks(blocks: Any, param: str) -> None:
    if not isinstance(blocks, list):
        raise bad_request(f"{param} must be a string or an array of content blocks", param)
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{param}[{j}] must be an object with a 'type'", f"{param}[{j}]")
        text = block.get("text")
        if block["type"] == "text" and text is not None and not isinstance(text, str):
            raise bad_request(f"{param}[{j}].text must be a string", f"{param}[{j}].text")


def check_messages(body: Mapping[str, Any], *, count_only: bool = False) -> None:
    """Raises OpenAIError (400) naming the parameter at fault. `count_only`: a count_tokens
    request (no max_tokens, no sampling)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' is required and must be an array", "messages")
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{param} must be an object", param)
        if m.get("role") not in ROLES:
            raise bad_request(f"{param}.role must be one of assistant, system, user",
                              f"{param}.role")  # fmt: skip
        content = m.get("content")
        if not isinstance(content, str):
            _check_blocks(content, f"{param}.content")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "system")
    if count_only:
        return
    limit = body.get("max_tokens")
    if not (is_int(limit) and limit >= 1):
        raise bad_request("'max_tokens' is required and must be a positive integer", "max_tokens")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be a boolean", "stream")
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(s, str) for s in stops)
    ):
        raise bad_request("'stop_sequences' must be an array of strings", "stop_sequences")
    for name in ("temperature", "top_p"):
        if body.get(name) is not None and not is_number(body[name]):
            raise bad_request(f"'{name}' must be a number", name)
    if body.get("top_k") is not None and not is_int(body["top_k"]):
        raise bad_request("'top_k' must be an integer", "top_k")


def _system_text(system: Any) -> str:
    """The top-level `system` as vLLM joins it: a string as is; text blocks' non-empty text
    joined with no separator, the billing header's blocks left out."""
    if isinstance(system, str):
        return system
    parts = []
    for block in system or ():
        text = block.get("text") if block.get("type") == "text" else None
        if isinstance(text, str) and text and not text.startswith(BILLING):
            parts.append(text)
    return "".join(parts)


def _message(m: Mapping[str, Any], out: list[dict[str, Any]]) -> dict[str, Any]:
    """One user or assistant message as vLLM converts it (_convert_message_content), block
    by block: a user's tool results go to `out` as tool messages as they come, before the
    message itself. NotReplayable when it holds a block Baton does not reproduce."""
    msg: dict[str, Any] = {"role": m["role"]}
    content: list[dict[str, Any]] | str = m["content"]  # checked: check_messages
    if isinstance(content, str):
        msg["content"] = content
        return msg
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        kind = block.get("type")
        if kind not in REPLAYED_BLOCKS:
            raise NotReplayable(f"its messages hold {kind} blocks")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "thinking" and block.get("thinking") is not None:
            if not isinstance(block["thinking"], str):
                raise NotReplayable("a thinking block whose thinking is not a string")
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(tools.tool_call(block))
        elif kind == "tool_result" and m["role"] == "user":
            out.append(tools.tool_messages(block))
        elif kind == "tool_result":
            parts.append(tools.assistant_result(block))
    # vLLM's keys in its order: reasoning, tool_calls, content (one text part: a string).
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if len(parts) == 1:
        msg["content"] = parts[0]["text"]
    elif parts:
        msg["content"] = parts
    return msg


def _converted(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The messages of the chat request vLLM builds, or NotReplayable saying why Baton
    cannot build them (an inline system message: vLLM merges those into the first or keeps
    them in place depending on the chat template; or a block above)."""
    out: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for m in body["messages"]:
        if m["role"] == "system":
            raise NotReplayable("its messages hold inline system messages")
        message = _message(m, out)
        # vLLM drops a user message left with nothing in it; an assistant one stays.
        if not (message["role"] == "user" and "content" not in message):
            out.append(message)
    return out


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The request's messages as the chat request vLLM builds from them, or None when Baton
    cannot reproduce that conversion (replay_refusal says why)."""
    try:
        return _converted(body)
    except NotReplayable:
        return None


def replay_refusal(body: Mapping[str, Any]) -> str | None:
    """Why this request cannot be replayed faithfully on another engine (None: it can)."""
    for name in NOT_REPLAYABLE:
        if body.get(name):
            return f"'{name}' cannot be replayed faithfully on another engine"
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        return "a thinking budget or effort (thinking.type enabled or disabled) cannot be resumed"
    try:
        _converted(body)
        tools.chat_tools(body)
    except NotReplayable as why:
        return f"{why} (vLLM's conversion of it cannot be reproduced faithfully)"
    return None


def as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The streamed chat request vLLM itself builds from this (replayable) request, with the
    same stream options, so its role chunk carries the prompt's usage for message_start."""
    chat: dict[str, Any] = {
        "model": body["model"],
        "messages": chat_messages(body),
        "max_tokens": body["max_tokens"],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    for name in COPIED:
        if body.get(name) is not None:
            chat[name] = body[name]
    chat.update(tools.chat_tools(body))  # replay_refusal checked they convert
    return chat


def hashed_messages(body: Mapping[str, Any]) -> list[Any]:
    """What the request's prefix is hashed from: its chat messages where Baton can build
    them, so a conversation's turns meet the same cache whether they come as chat or as
    messages; otherwise the system prompt and the messages as they are."""
    converted = chat_messages(body)
    if converted is not None:
        return converted
    system = _system_text(body.get("system"))
    head: list[Any] = [{"role": "system", "content": system}] if system else []
    return [*head, *body["messages"]]
