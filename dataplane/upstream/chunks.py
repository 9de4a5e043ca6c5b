"""What an engine's chunk says, read the same way for the first stream and resumed ones:
validated (parse_chunk: garbage and in-band errors are failures, never a cut stream), its
text, whether it failed."""

# baton: pure

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import orjson

from baton.model import Failure

FAILED_FINISH = frozenset({"abort", "error"})
ERROR_CHARS = 80  # of an engine's error type kept for events


# A token id as the shim holds it (4 bytes: dataplane/relay/progress.py): an engine's id
# outside that is garbage, caught here rather than where it is stored.
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class Choice(msgspec.Struct):
    """The fields of a streamed choice the shim reads, typed: anything else in it is relayed
    as the engine sent it, never read."""

    index: int = 0
    delta: dict[str, Any] | None = None  # chat; a dict, so that every key in it is seen
    text: str | None = None  # completions
    finish_reason: str | None = None
    stop_reason: Any = None
    token_ids: list[TokenId] | None = None
    prompt_token_ids: list[TokenId] | None = None
    logprobs: Any = None


class Chunk(msgspec.Struct):
    """An engine's streamed chunk as the shim reads it (parse_chunk)."""

    id: Any = ""
    created: Any = 0
    model: Any = ""
    system_fingerprint: Any = None
    choices: list[Choice] | None = None
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[TokenId] | None = None  # vLLM's chat: top level, first chunk only
    error: Any = msgspec.UNSET


# Validates as it decodes, in C: one pass for what orjson.loads and a walk of the dict in
# Python did (a third of the shim's cost of a relayed token went to those two).
_chunk = msgspec.json.Decoder(Chunk)


def choice_text(choice: Choice, chat: bool) -> str:
    if chat:
        return (choice.delta or {}).get("content") or ""
    return choice.text or ""


def choice_text_whole(choice: dict[str, Any]) -> str:
    """The text of a non-streamed choice, chat or completion."""
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def parse_chunk(data: bytes, choices: int) -> tuple[Chunk | None, Failure | None]:
    """An engine's chunk (of a stream of `choices` choices) as a Chunk, or (None, why it is
    not one the shim can relay): the same test for the first stream and a resumed one.
    Garbage is bad JSON, or a chunk whose fields the shim reads have the wrong types or a
    choice index the request cannot have: tracking it would raise mid-stream and cut the
    client's stream silently; classified, it fails over or ends in an error event."""
    try:
        chunk = _chunk.decode(data)
    except msgspec.DecodeError:  # ValidationError (a field's type) is one
        return None, Failure.GARBAGE
    chs = chunk.choices
    if chunk.error is not msgspec.UNSET and not chs:
        return None, Failure.ERROR_EVENT
    usage = chunk.usage
    if usage is not None and type(usage.get("prompt_tokens", 0)) is not int:
        return None, Failure.GARBAGE
    for ch in chs or ():
        if not 0 <= ch.index < choices:
            return None, Failure.GARBAGE
        delta = ch.delta
        if delta is not None:
            content = delta.get("content")
            if content is not None and type(content) is not str:
                return None, Failure.GARBAGE
    return chunk, None


def as_dict(data: bytes) -> dict[str, Any]:
    """A chunk parse_chunk accepted, whole, for the rare edit of what an engine sent."""
    obj: dict[str, Any] = orjson.loads(data)
    return obj


def error_type(raw: bytes) -> str:
    """The type (or code) of an OpenAI-shaped error body or in-band error chunk
    (llama-server's "server_error", vLLM's "InternalServerError"), for events and logs; ""
    when there is none. Only the type: an engine's message may quote the request, and
    events carry no prompt text."""
    try:
        err = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    kind = err.get("type") or err.get("code") if isinstance(err, dict) else None
    return kind[:ERROR_CHARS] if isinstance(kind, str) and kind.isprintable() else ""
