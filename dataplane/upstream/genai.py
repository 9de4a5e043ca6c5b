"""OpenTelemetry GenAI semantic conventions for an upstream attempt's CLIENT span: its name
(`{gen_ai.operation.name} {gen_ai.request.model}`) and attributes, from the request, the
backend and what the engine answered. Only sizes, ids and parameters: never prompt or
completion text. docs/observability.md lists every attribute and where it comes from."""

# baton: pure

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from baton.model import Backend
from dataplane.request import Endpoint

Attributes = dict[str, str | int | float | bool | list[str]]

# gen_ai.operation.name per endpoint. A Responses request is a conversation turn: "chat",
# as the conventions name OpenAI's chat APIs. Rerank, score and tokenize have no GenAI
# operation: their spans keep HTTP's "POST {path}" name.
OPERATION = {
    Endpoint.CHAT: "chat",
    Endpoint.RESPONSES: "chat",
    Endpoint.MESSAGES: "chat",  # Anthropic's Messages API: a chat turn too
    Endpoint.COMPLETIONS: "text_completion",
    Endpoint.EMBEDDINGS: "embeddings",
}
# The request's own parameter for each gen_ai.request.* attribute, in the order looked up.
REQUEST_PARAMS = {
    "gen_ai.request.max_tokens": ("max_completion_tokens", "max_tokens", "max_output_tokens"),
    "gen_ai.request.temperature": ("temperature",),
    "gen_ai.request.top_p": ("top_p",),
    "gen_ai.request.top_k": ("top_k",),
    "gen_ai.request.seed": ("seed",),
}


def span_name(endpoint: Endpoint, model: str) -> str:
    op = OPERATION.get(endpoint)
    return f"{op} {model}" if op else f"POST {endpoint.value}"


def request_attributes(
    endpoint: Endpoint, body: Mapping[str, Any], model: str, backend: Backend
) -> Attributes:
    attrs: Attributes = {
        "gen_ai.provider.name": backend.kind.value,
        "gen_ai.request.model": model,
    }
    op = OPERATION.get(endpoint)
    if op:
        attrs["gen_ai.operation.name"] = op
    for name, params in REQUEST_PARAMS.items():
        value = next((body[p] for p in params if body.get(p) is not None), None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attrs[name] = value
    url = urlsplit(backend.url)
    if url.hostname:
        attrs["server.address"] = url.hostname
    if url.port:
        attrs["server.port"] = url.port
    return attrs


def answer_attributes(answer: Any) -> Attributes:
    """From a whole answer: chat/completions (choices, usage), embeddings (usage) or a
    Responses object (output status, usage in its own names)."""
    if not isinstance(answer, dict):
        return {}
    usage: dict[str, Any] = answer["usage"] if isinstance(answer.get("usage"), dict) else {}
    finishes: list[str] = []
    if isinstance(answer.get("choices"), list):
        finishes = [c["finish_reason"] for c in answer["choices"]
                    if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)]  # fmt: skip
    elif answer.get("object") == "response" and isinstance(answer.get("status"), str):
        finishes = [answer["status"]]
    elif answer.get("type") == "message" and isinstance(answer.get("stop_reason"), str):
        finishes = [answer["stop_reason"]]
    return result_attributes(
        answer.get("id"),
        answer.get("model"),
        finishes,
        usage.get("prompt_tokens", usage.get("input_tokens")),
        usage.get("completion_tokens", usage.get("output_tokens")),
    )


def result_attributes(
    response_id: Any, model: Any, finishes: Iterable[str | None], inputs: Any, outputs: Any
) -> Attributes:
    attrs: Attributes = {}
    if isinstance(response_id, str) and response_id:
        attrs["gen_ai.response.id"] = response_id
    if isinstance(model, str) and model:
        attrs["gen_ai.response.model"] = model
    reasons = [f for f in finishes if f]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    for name, value in (("gen_ai.usage.input_tokens", inputs),
                        ("gen_ai.usage.output_tokens", outputs)):  # fmt: skip
        if isinstance(value, int) and not isinstance(value, bool):
            attrs[name] = value
    return attrs
