"""One-shot calls: embeddings, rerank, score, tokenize, detokenize and the Messages API's
count_tokens (whose body dataplane/messages/request.py checks). Each is one request and
one whole answer, routed by `model` like chat (retried on the next backend before anything
reached the client, the failing backend demoted), with no prefix pin (a pooling call gains
nothing from a warm KV cache, so spreading is right) and no mid-answer failover (there is no
stream to resume). What a router must trust is checked here; the engine validates the rest."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dataplane.exceptions import ErrorKind, OpenAIError
from dataplane.request import Endpoint


def _bad(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(ErrorKind.INVALID_REQUEST, message, param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(t) for t in v)


def _required(body: Mapping[str, Any], name: str) -> Any:
    value = body.get(name)
    if value is None:
        raise _bad(f"'{name}' is required", name)
    return value


def _texts(value: Any, name: str) -> None:
    """A string or a non-empty array of strings."""
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return
    raise _bad(f"'{name}' must be a string or a non-empty array of strings", name)


def _embeddings(body: Mapping[str, Any]) -> None:
    value = _required(body, "input")
    if isinstance(value, str) or _ids(value):
        return
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value) or all(_ids(v) for v in value):
            return
    raise _bad(
        "'input' must be a string, an array of strings, an array of token ids or an array of "
        "token-id arrays",
        "input",
    )


def _rerank(body: Mapping[str, Any]) -> None:
    if not isinstance(_required(body, "query"), str):
        raise _bad("'query' must be a string", "query")
    documents = _required(body, "documents")
    if not (isinstance(documents, list) and documents):
        raise _bad("'documents' must be a non-empty array", "documents")
    top_n = body.get("top_n")
    if top_n is not None and not (_is_int(top_n) and top_n >= 0):
        raise _bad("'top_n' must be a non-negative integer", "top_n")


def _score(body: Mapping[str, Any]) -> None:
    # vLLM's names (text_1/text_2), or the newer queries/documents pair.
    first, second = ("queries", "documents") if "queries" in body else ("text_1", "text_2")
    for name in (first, second):
        _texts(_required(body, name), name)


def _tokenize(body: Mapping[str, Any]) -> None:
    if "messages" in body:
        messages = body["messages"]
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict)
                                                                 for m in messages)):
            raise _bad("'messages' must be a non-empty array of objects", "messages")  # fmt: skip
        return
    if not isinstance(_required(body, "prompt"), str):
        raise _bad("'prompt' must be a string", "prompt")


def _detokenize(body: Mapping[str, Any]) -> None:
    tokens = _required(body, "tokens")
    if not (isinstance(tokens, list) and all(_is_int(t) for t in tokens)):
        raise _bad("'tokens' must be an array of token ids", "tokens")


_CHECKS: dict[Endpoint, Callable[[Mapping[str, Any]], None]] = {
    Endpoint.EMBEDDINGS: _embeddings,
    Endpoint.RERANK: _rerank,
    Endpoint.RERANK_BARE: _rerank,
    Endpoint.SCORE: _score,
    Endpoint.TOKENIZE: _tokenize,
    Endpoint.DETOKENIZE: _detokenize,
}

# What a 200 answer must carry to be relayed: anything else is a garbled answer, retried on
# the next backend like any failure, never relayed as a success.
_ANSWER_FIELD: dict[Endpoint, tuple[str, type]] = {
    Endpoint.EMBEDDINGS: ("data", list),
    Endpoint.RERANK: ("results", list),
    Endpoint.RERANK_BARE: ("results", list),
    Endpoint.SCORE: ("data", list),
    Endpoint.TOKENIZE: ("tokens", list),
    Endpoint.DETOKENIZE: ("prompt", str),
    Endpoint.COUNT_TOKENS: ("input_tokens", int),
}


def check_one_shot(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    """Raises OpenAIError (400) naming the parameter at fault. (count_tokens: not here.)"""
    _CHECKS[endpoint](body)


def garbled(endpoint: Endpoint, answer: Any) -> str | None:
    """Why a 200 answer to a one-shot call cannot be relayed (None: it can)."""
    field, kind = _ANSWER_FIELD[endpoint]
    if not isinstance(answer, dict):
        return "a 200 answer that is not a JSON object"
    if not isinstance(answer.get(field), kind):
        return f"a 200 answer without '{field}'"
    return None
