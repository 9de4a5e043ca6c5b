"""One-shot calls: embeddings, rerank, score, tokenize, detokenize and the Messages API's
count_tokens (whose body dataplane/messages/request.py checks). Each is one request and
one whole answer, routed by `model` like chat (retried on the next backend before anything
reached the client, the failing backend demoted), with no prefix pin (a pooling call gains
nothing from a warm KV cache, so spreading is right) and no mid-answer failover (there is no
stream to resume). What a router must trust is checked here; the engine validates the rest."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dataplane.apis.answers import garbage
from dataplane.apis.api import Plain
from dataplane.exceptions import ErrorShape, bad_request
from dataplane.request import is_int


def _ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(is_int(t) for t in v)


def _required(body: Mapping[str, Any], name: str) -> Any:
    value = body.get(name)
    if value is None:
        raise bad_request(f"'{name}' is required", name)
    return value


def _texts(value: Any, name: str) -> None:
    """A string or a non-empty array of strings."""
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return
    raise bad_request(f"'{name}' must be a string or a non-empty array of strings", name)


def _embeddings(body: Mapping[str, Any]) -> None:
    value = _required(body, "input")
    if isinstance(value, str) or _ids(value):
        return
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value) or all(_ids(v) for v in value):
            return
    raise bad_request(
        "'input' must be a string, an array of strings, an array of token ids or an array of "
        "token-id arrays",
        "input",
    )


def _rerank(body: Mapping[str, Any]) -> None:
    if not isinstance(_required(body, "query"), str):
        raise bad_request("'query' must be a string", "query")
    documents = _required(body, "documents")
    if not (isinstance(documents, list) and documents):
        raise bad_request("'documents' must be a non-empty array", "documents")
    top_n = body.get("top_n")
    if top_n is not None and not (is_int(top_n) and top_n >= 0):
        raise bad_request("'top_n' must be a non-negative integer", "top_n")


def _score(body: Mapping[str, Any]) -> None:
    # vLLM's names (text_1/text_2), or the newer queries/documents pair.
    first, second = ("queries", "documents") if "queries" in body else ("text_1", "text_2")
    for name in (first, second):
        _texts(_required(body, name), name)


def _tokenize(body: Mapping[str, Any]) -> None:
    if "messages" in body:
        messages = body["messages"]
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) for m in messages)):
            raise bad_request("'messages' must be a non-empty array of objects",
                              "messages")  # fmt: skip
        return
    if not isinstance(_required(body, "prompt"), str):
        raise bad_request("'prompt' must be a string", "prompt")


def _detokenize(body: Mapping[str, Any]) -> None:
    tokens = _required(body, "tokens")
    if not (isinstance(tokens, list) and all(is_int(t) for t in tokens)):
        raise bad_request("'tokens' must be an array of token ids", "tokens")


@dataclass(frozen=True)
class OneShot(Plain):
    """One whole answer, which must carry `field` of type `kind` to be relayed: anything else
    is a garbled answer, retried on the next backend like any failure."""

    checks: Callable[[Mapping[str, Any]], None]
    field: str
    kind: type
    errors: ErrorShape = ErrorShape.OPENAI
    forwarded: tuple[str, ...] = ()

    def check(self, body: Mapping[str, Any]) -> None:
        self.checks(body)

    def answer(self, obj: Any) -> str | None:
        if not isinstance(obj, dict):
            raise garbage("a 200 answer that is not a JSON object")
        if not isinstance(obj.get(self.field), self.kind):
            raise garbage(f"a 200 answer without '{self.field}'")
        return None


EMBEDDINGS = OneShot(_embeddings, "data", list)
RERANK = OneShot(_rerank, "results", list)
SCORE = OneShot(_score, "data", list)
TOKENIZE = OneShot(_tokenize, "tokens", list)
DETOKENIZE = OneShot(_detokenize, "prompt", str)
