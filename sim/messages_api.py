"""A Messages API request as the chat completion request vLLM 0.32 turns it into (pure).

vLLM serves /v1/messages by converting the (validated, sim.messages_request) body into
a ChatCompletionRequest (entrypoints/anthropic/serving.py, ``to_chat_completion_request``)
and running its chat server; ``chat_body`` builds that request as a chat body, so the
sim's own chat path (sim.protocol.parse_chat) renders the same template and generates
the same tokens for both. Field by field:

* ``system`` (a string, or text blocks joined with no separator, blocks starting
  "x-anthropic-billing-header" dropped) becomes a first system message; a message
  with role "system" stays a system message where it is (its text, when any).
* a message's string content is kept; blocks become: text -> a text part (one part
  alone becomes a string), thinking -> the message's ``reasoning``, tool_use ->
  ``tool_calls`` (arguments ``json.dumps(input)``; no id: "call_0", where vLLM
  writes "call_<unix time>"), a user's tool_result -> a
  ``tool`` message before it (text parts joined with newlines), an assistant's
  tool_result -> a "Tool result: ..." text part, image -> an image_url part;
  redacted_thinking and tool_reference are dropped, and a user message left
  with no content is dropped.
* ``max_tokens`` -> max_tokens and max_completion_tokens; ``stop_sequences`` -> stop;
  ``temperature``, ``top_p``, ``top_k``, ``cache_salt``, ``chat_template_kwargs``,
  ``kv_transfer_params``, ``vllm_xargs``, ``watermarking`` as they are.
* ``stream`` -> stream with stream_options {include_usage, continuous_usage_stats}.
* ``thinking``: enabled -> thinking_token_budget = budget_tokens; disabled ->
  reasoning_effort "low" (vLLM's probe picks "none" only for a template that
  renders it differently from every effort; the toy template ignores efforts);
  adaptive -> nothing. ``output_config``: effort -> reasoning_effort, format ->
  response_format json_schema.
* ``tool_choice``: auto -> "auto", any -> "required", none -> "none", tool -> the
  named function, and parallel_tool_calls = not disable_parallel_tool_use; ``tools``
  (after tool_addition/tool_removal blocks) -> function tools, tool_choice "auto"
  when none was given.
* ``metadata`` is dropped.

Where the sim's chat would refuse what vLLM assigns after building its request (and
so never validates): tool_choice without tools, or an empty tools list, is left out.
The toy template accepts system messages anywhere, so inline system messages are not
merged into the first one (vLLM merges them for templates that require system first).
"""

# baton: pure

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sim.messages_request import Body
from sim.protocol import bad_request

BILLING_HEADER = "x-anthropic-billing-header"
DISABLED_THINKING_EFFORT = "low"
_PASSED = (
    "temperature", "top_p", "top_k", "watermarking", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "chat_template_kwargs",
)  # fmt: skip
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}

Message = dict[str, Any]


def chat_body(req: Body, *, count_only: bool = False) -> dict[str, Any]:
    """The chat request vLLM builds for this Messages (or count_tokens) request."""
    body: dict[str, Any] = {"model": req["model"], "messages": messages(req)}
    if not count_only:
        body["max_tokens"] = body["max_completion_tokens"] = req["max_tokens"]
        if req["stop_sequences"] is not None:
            body["stop"] = req["stop_sequences"]
        body.update((k, req[k]) for k in _PASSED if req[k] is not None)
        if req["stream"]:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    elif req["chat_template_kwargs"] is not None:
        body["chat_template_kwargs"] = req["chat_template_kwargs"]
    config = req["output_config"] or {}
    schema = (config.get("format") or {}).get("schema")
    if schema:
        body["response_format"] = {
            "type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema},
        }  # fmt: skip
    if config.get("effort") is not None:
        body["reasoning_effort"] = config["effort"]
    thinking = req["thinking"] or {}
    if thinking.get("type") == "disabled":
        body["reasoning_effort"] = DISABLED_THINKING_EFFORT
    elif thinking.get("type") == "enabled":
        body["thinking_token_budget"] = thinking["budget_tokens"]
    body.update(_tools(req))
    return body


def messages(req: Body) -> list[Message]:
    out: list[Message] = []
    system = _system_text(req["system"]) if req["system"] else None
    if system:
        out.append({"role": "system", "content": system})
    for msg in req["messages"]:
        if msg["role"] == "system":
            text = _system_text(msg["content"])
            if text:
                out.append({"role": "system", "content": text})
            continue
        converted: Message = {"role": msg["role"]}
        if isinstance(msg["content"], str):
            converted["content"] = msg["content"]
        else:
            _blocks(msg["role"], msg["content"], converted, out)
        if not (msg["role"] == "user" and "content" not in converted):
            out.append(converted)
    return out


def _system_text(content: str | Sequence[Mapping[str, Any]]) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [
        b["text"] for b in content
        if b["type"] == "text" and b["text"] and not b["text"].startswith(BILLING_HEADER)
    ]  # fmt: skip
    return "".join(parts) if parts else None


def _blocks(role: str, blocks: Sequence[Body], msg: Message, out: list[Message]) -> None:
    """A message's content blocks (vLLM's _convert_message_content); tool results of a
    user message go to ``out`` as tool messages first."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for b in blocks:
        kind = b["type"]
        if kind == "text" and b["text"]:
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and b["source"]:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b["source"])}})
        elif kind == "thinking" and b["thinking"] is not None:
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            calls.append({
                "id": b["id"] or "call_0", "type": "function",
                "function": {"name": b["name"] or "", "arguments": json.dumps(b["input"] or {})},
            })  # fmt: skip
        elif kind == "tool_result" and role == "user":
            out.extend(_tool_messages(b))
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {b['content'] or ''}"})
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        msg["content"] = parts[0]["text"]
    elif parts:
        msg["content"] = parts


def _tool_messages(b: Body) -> list[Message]:
    content, text, images, refs = b["content"], "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image" and (url := _image_url(item.get("source", {}))):
                images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = b["tool_use_id"] or ""
    out: list[Message] = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
        out.append({"role": "user", "content": parts})
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})
    return out


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tools(req: Body) -> dict[str, Any]:
    out: dict[str, Any] = {}
    choice = req["tool_choice"]
    if choice is not None:
        out["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
        named = {"type": "function", "function": {"name": choice["name"]}}
        out["tool_choice"] = _TOOL_CHOICE.get(choice["type"], named)
    tools = resolve_tools(req)
    if tools is not None:
        fields = (("name", "name"), ("description", "description"), ("parameters", "input_schema"),
                  ("strict", "strict"), ("defer_loading", "defer_loading"))  # fmt: skip
        out["tools"] = [
            {"type": "function",
             "function": {k: t[src] for k, src in fields if t[src] is not None}}
            for t in tools
        ]  # fmt: skip
        out.setdefault("tool_choice", "auto")
    if not out.get("tools"):  # see the module's docstring
        out.pop("tools", None)
        out.pop("tool_choice", None)
    return out


def resolve_tools(req: Body) -> list[Body] | None:
    """``tools`` after the conversation's tool_addition/tool_removal blocks (vLLM's
    _resolve_tools): the tools in effect at its end."""
    changes = [
        b for m in req["messages"] if not isinstance(m["content"], str)
        for b in m["content"] if b["type"] in ("tool_addition", "tool_removal")
    ]  # fmt: skip
    if not changes:
        declared: list[Body] | None = req["tools"]
        return declared
    tools = {t["name"]: t for t in req["tools"] or []}
    removed: set[str] = set()
    for b in changes:
        change = b["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            tools[name] = change["definition"]
        else:
            name = change["name"]
            if name not in tools:
                raise bad_request(
                    f"{b['type']} references tool {name!r}, which is not declared in tools"
                )
            if b["type"] == "tool_addition":
                tools[name] = {**tools[name], "defer_loading": None}
        if b["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for name, t in tools.items() if name not in removed]
