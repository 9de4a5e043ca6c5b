"""The one table from endpoint to API, and a request's validation through it: the body
parsed, the fields every API shares checked (fields.py), then the API's own."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from dataplane.apis import chat, messages, oneshot, responses
from dataplane.apis.api import Api
from dataplane.apis.fields import check_model, client_request
from dataplane.exceptions import ErrorKind, OpenAIError, bad_request
from dataplane.request import ClientRequest, Endpoint

APIS: Mapping[Endpoint, Api] = {
    Endpoint.CHAT: chat.CHAT,
    Endpoint.COMPLETIONS: chat.COMPLETIONS,
    Endpoint.RESPONSES: responses.RESPONSES,
    Endpoint.MESSAGES: messages.MESSAGES,
    Endpoint.EMBEDDINGS: oneshot.EMBEDDINGS,
    Endpoint.RERANK: oneshot.RERANK,
    Endpoint.RERANK_BARE: oneshot.RERANK,
    Endpoint.SCORE: oneshot.SCORE,
    Endpoint.TOKENIZE: oneshot.TOKENIZE,
    Endpoint.DETOKENIZE: oneshot.DETOKENIZE,
    Endpoint.COUNT_TOKENS: messages.COUNT_TOKENS,
}


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
        raise bad_request("request body must be a JSON object", None)
    return body


def validate(body: dict[str, Any], endpoint: Endpoint) -> ClientRequest:
    """Returns a ClientRequest or raises OpenAIError (400) with the parameter at fault."""
    model = check_model(body)
    APIS[endpoint].check(body)
    return client_request(endpoint, body, model)


def parse_request(raw: bytes, endpoint: Endpoint, max_bytes: int) -> ClientRequest:
    return validate(parse_body(raw, max_bytes), endpoint)
