"""The endpoints the shim serves by routing them to an engine."""

# baton: pure

from __future__ import annotations

from enum import StrEnum


class Endpoint(StrEnum):
    """What a client POSTs to, and the path the engine is sent the request on."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    # One-shot calls (oneshot.py): routed by model, retried before the answer, never resumed.
    EMBEDDINGS = "/v1/embeddings"
    RERANK = "/v1/rerank"
    RERANK_BARE = "/rerank"  # vLLM's unversioned alias
    SCORE = "/v1/score"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"

    @property
    def generates(self) -> bool:
        """A generation endpoint: streamed or not, its answer can be resumed or pinned."""
        return self in _GENERATING


_GENERATING = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES})
