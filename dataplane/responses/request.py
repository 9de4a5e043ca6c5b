"""A Responses API request, read the way vLLM reads it: what a router must trust (the model,
the input's shape, `store`, `previous_response_id`), and whether the request can be replayed
faithfully on another engine (`as_chat`).

A request can be replayed when everything that decides its tokens is in the request itself:
`store: false` (nothing of it must live on the engine that served it), no
`previous_response_id` (its context is not on one engine), input that renders through the
chat template as chat messages (text messages, function calls and their outputs), function
tools with tool_choice auto or none, and no reasoning or constrained output (a resume runs
neither, nor the guided decoding of a forced or strict tool call). Such a request is the
chat request `as_chat` returns: the same messages go through the same template on the same
engine, so it generates the same tokens, and a chat stream carries the token ids a
token-exact resume needs, which a Responses stream does not."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dataplane.exceptions import bad_request
from dataplane.request import is_int
from dataplane.responses import convert
from dataplane.responses.convert import NotReplayable

# Copied to the chat request unchanged: the sampling fields vLLM's Responses API accepts.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty",
            "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
            "user", "priority")  # fmt: skip
# Parameters that put something outside the request into the answer, or that a resume cannot
# reproduce: such a request is relayed as the engine streams it, and not resumed (tools are
# replayed or refused by dataplane/responses/convert.py).
NOT_REPLAYABLE = ("reasoning", "include", "top_logprobs", "background", "prompt",
                  "previous_input_messages", "structured_outputs", "frequency_penalty",
                  "presence_penalty", "logit_bias", "max_tool_calls")  # fmt: skip


def check_responses(body: Mapping[str, Any]) -> None:
    """Raises OpenAIError (400) naming the parameter at fault."""
    value = body.get("input")
    if value is None:
        raise bad_request("'input' is required", "input")
    if not (isinstance(value, str) or (isinstance(value, list) and value)):
        raise bad_request("'input' must be a string or a non-empty array of items", "input")
    if isinstance(value, list) and not all(isinstance(item, dict) for item in value):
        raise bad_request("every item of 'input' must be an object", "input")
    for name in ("store", "stream"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"'{name}' must be a boolean", name)
    prev = body.get("previous_response_id")
    if prev is not None and not (isinstance(prev, str) and prev):
        raise bad_request("'previous_response_id' must be a non-empty string",
                          "previous_response_id")  # fmt: skip
    limit = body.get("max_output_tokens")
    if limit is not None and not (is_int(limit) and limit >= 1):
        raise bad_request("'max_output_tokens' must be an integer of at least 1",
                          "max_output_tokens")  # fmt: skip
    for name in ("instructions",):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad_request(f"'{name}' must be a string", name)


def stored(body: Mapping[str, Any]) -> bool:
    """Whether the engine keeps the response for later (vLLM: `store` defaults to true)."""
    return body.get("store") is not False


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The request as chat messages (instructions first, as a system message, then its
    input as vLLM renders it: dataplane/responses/convert.py), or None when Baton cannot
    reproduce that rendering (replay_refusal says why)."""
    try:
        return _messages(body)
    except NotReplayable:
        return None


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        out.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        return [*out, {"role": "user", "content": value}]
    return [*out, *convert.input_messages(value if isinstance(value, list) else [])]


def replay_refusal(body: Mapping[str, Any]) -> str | None:
    """Why this request cannot be replayed faithfully on another engine (None: it can)."""
    if stored(body):
        return "it is stored (store: true): its state lives on the engine that serves it"
    if body.get("previous_response_id"):
        return "it continues a stored response (previous_response_id) held by one engine"
    for name in NOT_REPLAYABLE:
        if body.get(name):
            return f"'{name}' cannot be replayed faithfully on another engine"
    fmt = body.get("text")
    if isinstance(fmt, dict) and isinstance(fmt.get("format"), dict):
        if fmt["format"].get("type", "text") != "text":
            return "structured output (text.format) cannot be resumed faithfully"
    try:
        _messages(body)
        convert.chat_tools(body)
    except NotReplayable as why:
        return f"{why} (vLLM's rendering of it cannot be reproduced faithfully)"
    return None


def as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The streamed chat request that generates what this (replayable) request would."""
    chat: dict[str, Any] = {
        "model": body["model"],
        "messages": messages_of(body),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in SAMPLING:
        if body.get(name) is not None:
            chat[name] = body[name]
    chat.update(convert.chat_tools(body))  # replay_refusal checked they convert
    return chat
