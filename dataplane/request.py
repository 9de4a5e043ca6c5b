"""A client's request as the shim carries it once validated (dataplane/apis/table.py): the
endpoint it came on, its body, and what routing and relaying read of it."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeGuard


class Endpoint(StrEnum):
    """What a client POSTs to, and the path the engine is sent the request on."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"  # Anthropic's Messages API (dataplane/messages/)
    # One-shot calls (dataplane/apis/oneshot.py): routed by model, retried before the answer,
    # never resumed.
    EMBEDDINGS = "/v1/embeddings"
    RERANK = "/v1/rerank"
    RERANK_BARE = "/rerank"  # vLLM's unversioned alias
    SCORE = "/v1/score"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"
    COUNT_TOKENS = "/v1/messages/count_tokens"

    @property
    def generates(self) -> bool:
        """A generation endpoint: streamed or not, its answer can be resumed or pinned."""
        return self in _GENERATING


_GENERATING = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES,
                         Endpoint.MESSAGES})  # fmt: skip


@dataclass(frozen=True, slots=True)
class ClientRequest:
    endpoint: Endpoint
    body: Mapping[str, Any]
    model: str
    stream: bool
    greedy: bool


def token_limit(body: Mapping[str, Any]) -> int | None:
    """The client's cap on generated tokens, as vLLM reads it: max_completion_tokens, else
    max_tokens (None: the engine's default). Valid bodies (_check_params) hold ints >= 1."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    return limit if is_int(limit) else None


def is_int(v: object) -> TypeGuard[int]:
    """An integer as JSON means it (true and false are not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)
