"""What an engine's chunk says, read the same way for the first stream and resumed ones:
validated (parse_chunk: garbage and in-band errors are failures, never a cut stream), its
text, whether it failed."""

# baton: pure

from __future__ import annotations

from typing import Any

import orjson

from baton.model import Failure

FAILED_FINISH = frozenset({"abort", "error"})
ERROR_CHARS = 80  # of an engine's error type kept for events


def choice_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        delta = choice.get("delta") or {}
        return delta.get("content") or ""
    return choice.get("text") or ""

def choice_text_whole(choice: dict[str, Any]) -> str:
    """The text of a non-streamed choice, chat or completion."""
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else ""

def parse_chunk(data: bytes, choices: int) -> tuple[dict[str, Any] | None, Failure | None]:
    """An engine's chunk (of a stream of `choices` choices) as an object, or (None, why it
    is not one the shim can relay): the same test for the first stream and a resumed one."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None, Failure.GARBAGE
    if not isinstance(obj, dict):
        return None, Failure.GARBAGE
    if "error" in obj and not obj.get("choices"):
        return None, Failure.ERROR_EVENT
    if malformed(obj, choices):
        return None, Failure.GARBAGE
    return obj, None

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


def malformed(obj: dict[str, Any], choices: int) -> bool:
    """A chunk whose fields the shim reads have the wrong types, or a choice index the
    request cannot have: garbage like bad JSON. Tracking it would raise mid-stream and cut
    the client's stream silently; classified, it fails over or ends in an error event.
    Called for every chunk: exact type tests (JSON gives exactly these types), each field
    read once."""
    usage = obj.get("usage")
    if usage is not None and not (
        type(usage) is dict and type(usage.get("prompt_tokens", 0)) is int
    ):
        return True
    chs = obj.get("choices")
    if chs is not None and type(chs) is not list:
        return True
    if not _ids_or_none(obj.get("prompt_token_ids")):
        return True
    for ch in chs or ():
        if type(ch) is not dict:
            return True
        index = ch.get("index", 0)
        if type(index) is not int or not 0 <= index < choices:
            return True
        delta = ch.get("delta")
        if delta is not None:
            if type(delta) is not dict:
                return True
            content = delta.get("content")
            if content is not None and type(content) is not str:
                return True
        text = ch.get("text")
        if text is not None and type(text) is not str:
            return True
        finish = ch.get("finish_reason")
        if finish is not None and type(finish) is not str:
            return True
        if not (_ids_or_none(ch.get("token_ids")) and _ids_or_none(ch.get("prompt_token_ids"))):
            return True
    return False

def _ids_or_none(v: Any) -> bool:
    # Called for every chunk: a plain loop, no generator. `type(t) is int` leaves out bool,
    # which JSON's true/false would be.
    if v is None:
        return True
    if type(v) is not list:
        return False
    for t in v:
        if type(t) is not int:
            return False
    return True
