"""What every API's request carries alike, checked once: the model, the sampling parameters
the shim reads, `stream`; and the ClientRequest built from a checked body. A capability that
crosses the APIs is written here (or in a module of its own beside it), not once per API."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dataplane.apis.api import Prompt
from dataplane.exceptions import bad_request
from dataplane.request import ClientRequest, Endpoint, is_int, is_number

# The longest model name the shim routes. Real names (a Hugging Face repo id, an adapter's
# name, a path) are well under it; a longer one is refused here, before it is echoed back in a
# 404 or carried to control in the route question (one 5 MB name cost control 19 MB of RSS).
MAX_MODEL_CHARS = 256

NUMBER_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
# best_of and min_tokens are vLLM extras the resume planner does arithmetic on.
INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "best_of", "min_tokens")
LEAST = (("max_tokens", 1), ("max_completion_tokens", 1), ("n", 1), ("best_of", 1),
         ("min_tokens", 0))  # fmt: skip


def check_model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model")
    if len(model) > MAX_MODEL_CHARS:
        # Never echo it: the point is that it goes nowhere.
        raise bad_request(f"'model' is {len(model)} characters long; the limit is "
                          f"{MAX_MODEL_CHARS}", "model")  # fmt: skip
    return model


def check_params(body: Mapping[str, Any]) -> None:
    """The sampling parameters of a generating request, in any API."""
    for name in NUMBER_FIELDS:
        if name in body and body[name] is not None and not is_number(body[name]):
            raise bad_request(f"'{name}' must be a number", name)
    for name in INT_FIELDS:
        if name in body and body[name] is not None and not is_int(body[name]):
            raise bad_request(f"'{name}' must be an integer", name)
    for name, least in LEAST:
        value = body.get(name)
        if value is not None and value < least:
            raise bad_request(f"'{name}' must be at least {least}", name)
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise bad_request("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")


def client_request(endpoint: Endpoint, body: Mapping[str, Any], model: str) -> ClientRequest:
    """The request, once its API has checked its body."""
    if not endpoint.generates:
        return ClientRequest(endpoint, body, model, False, False)
    temperature = body.get("temperature")
    # vLLM's default temperature is 1.0 unless the model's generation config says otherwise,
    # so only an explicit 0 is greedy.
    greedy = temperature is not None and temperature == 0
    return ClientRequest(endpoint, body, model, bool(body.get("stream")), greedy)


def prompt_of(messages: list[Any]) -> Prompt:
    """A conversation's prompt: its messages, which are the assistant's, and their text's
    length (non-text parts may carry "text": null, as SDKs dump them: only strings count)."""
    turns = tuple(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
    chars = sum(_chars(m.get("content")) for m in messages if isinstance(m, dict))
    return Prompt(messages, turns, chars)


def _chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(t) for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str)
        )
    return 0
