"""Pure validation of OpenAI request bodies. Returns a ClientRequest or raises OpenAIError
with the parameter at fault. Checks what a router must trust (types it reads, required
fields); everything else is passed to the engine untouched, which validates the rest."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from dataplane.exceptions import ErrorKind, OpenAIError
from dataplane.messages.request import check_messages
from dataplane.relay.oneshot import check_one_shot
from dataplane.request import ClientRequest, Endpoint
from dataplane.responses.request import check_responses

ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
# The longest model name the shim routes. Real names (a Hugging Face repo id, an adapter's
# name, a path) are well under it; a longer one is refused here, before it is echoed back in a
# 404 or carried to control in the route question (one 5 MB name cost control 19 MB of RSS).
MAX_MODEL_CHARS = 256


def _bad(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(ErrorKind.INVALID_REQUEST, message, param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def parse_body(raw: bytes, max_bytes: int) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise OpenAIError(
            ErrorKind.BODY_TOO_LARGE, f"request body is {len(raw)} bytes; the limit is {max_bytes}"
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(
            ErrorKind.INVALID_JSON, f"request body is not valid JSON: {exc}"
        ) from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    return body


def _check_messages(messages: Any) -> None:
    if messages is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{param} must be an object", param)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"{param}.role must be one of {', '.join(sorted(ROLES))}", f"{param}.role")
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            continue
        if not isinstance(content, str | list):
            raise _bad(f"{param}.content must be a string or an array of parts", f"{param}.content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _bad(
                        f"{param}.content[{j}] must be an object with a 'type'",
                        f"{param}.content[{j}]",
                    )
                # The shim measures text parts for the request's shape.
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise _bad(
                        f"{param}.content[{j}].text must be a string", f"{param}.content[{j}].text"
                    )


def _check_prompt(prompt: Any) -> None:
    if prompt is None:
        raise _bad("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_int(p) for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return
    raise _bad("'prompt' must be a string, an array of strings or an array of token ids", "prompt")


NUMBER_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
# best_of and min_tokens are vLLM extras the resume planner does arithmetic on.
INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "best_of", "min_tokens")


def _check_params(body: Mapping[str, Any]) -> None:
    for name in NUMBER_FIELDS:
        if name in body and body[name] is not None and not _is_number(body[name]):
            raise _bad(f"'{name}' must be a number", name)
    for name in INT_FIELDS:
        if name in body and body[name] is not None and not _is_int(body[name]):
            raise _bad(f"'{name}' must be an integer", name)
    for name, least in (
        ("max_tokens", 1),
        ("max_completion_tokens", 1),
        ("n", 1),
        ("best_of", 1),
        ("min_tokens", 0),
    ):
        value = body.get(name)
        if value is not None and value < least:
            raise _bad(f"'{name}' must be at least {least}", name)
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _bad("'stop' must be a string or an array of strings", "stop")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise _bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")


def validate(body: dict[str, Any], endpoint: Endpoint) -> ClientRequest:
    model = body.get("model")
    if model is None:
        raise _bad("'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    if len(model) > MAX_MODEL_CHARS:
        # Never echo it: the point is that it goes nowhere.
        raise _bad(f"'model' is {len(model)} characters long; the limit is {MAX_MODEL_CHARS}",
                   "model")  # fmt: skip
    if endpoint is Endpoint.COUNT_TOKENS:
        check_messages(body, count_only=True)
        return ClientRequest(endpoint, body, model, False, False)
    if not endpoint.generates:
        check_one_shot(body, endpoint)
        return ClientRequest(endpoint, body, model, False, False)
    if endpoint is Endpoint.CHAT:
        _check_messages(body.get("messages"))
    elif endpoint is Endpoint.COMPLETIONS:
        _check_prompt(body.get("prompt"))
    elif endpoint is Endpoint.MESSAGES:
        check_messages(body)
    else:
        check_responses(body)
    _check_params(body)
    temperature = body.get("temperature")
    # vLLM's default temperature is 1.0 unless the model's generation config says otherwise,
    # so only an explicit 0 is greedy.
    greedy = temperature is not None and temperature == 0
    return ClientRequest(endpoint, body, model, bool(body.get("stream")), greedy)


def parse_request(raw: bytes, endpoint: Endpoint, max_bytes: int) -> ClientRequest:
    return validate(parse_body(raw, max_bytes), endpoint)
