"""Logprobs in the client's shape (pure), for a resumed stream's tokens: the generate
endpoint gives them in chat's shape (dataplane/relay/resume/generate.py), each token's entry
{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}...]} with its candidates in
vLLM's order (the sampled token first, then the top ranks). A chat client gets them as they
are, its `top_logprobs` long; a completions client gets vLLM's completions shape."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def as_chat(entries: Sequence[Mapping[str, Any]], k: int) -> dict[str, Any]:
    """Chat's `logprobs` of a chunk: the generate endpoint gives at least one candidate,
    chat exactly the first k (none for k 0)."""
    return {"content": [{**e, "top_logprobs": list(e.get("top_logprobs") or [])[:k]}
                        for e in entries]}  # fmt: skip


def as_completions(
    entries: Sequence[Mapping[str, Any]], offset: int
) -> tuple[dict[str, Any], int]:
    """Completions' `logprobs` of a chunk whose first token's text_offset is `offset`, and
    the next token's. vLLM keys each token's candidates by decoded token (a later equal key
    keeps the first one's place and takes its value) and runs text_offset over the decoded
    tokens' lengths."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                           "top_logprobs": []}  # fmt: skip
    for e in entries:
        out["text_offset"].append(offset)
        offset += len(e["token"])
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        top: dict[str, float] = {}
        for c in e.get("top_logprobs") or [e]:
            top[c["token"]] = c["logprob"]
        out["top_logprobs"].append(top)
    return out, offset


def next_offset(shaped: Mapping[str, Any], offset: int) -> int:
    """The text_offset after a completions chunk's logprobs (as the engine sent them)."""
    offsets, tokens = shaped.get("text_offset"), shaped.get("tokens")
    if isinstance(offsets, list) and offsets and isinstance(tokens, list) and tokens:
        last = tokens[-1]
        return int(offsets[-1]) + (len(last) if isinstance(last, str) else 0)
    return offset


def entries_of(raw: Any) -> list[dict[str, Any]]:
    """A generate chunk's choice `logprobs` (chat's shape) as its list of entries."""
    content = raw.get("content") if isinstance(raw, dict) else None
    return [e for e in content if isinstance(e, dict)] if isinstance(content, list) else []
