"""Pure: a request's shape for control — sizes and keyed hashes, never prompt text.

prefix chain: h_i = H_key(h_{i-1} || canonical(message_i)); two conversations share h_i
exactly when their first i messages are identical, which is what prefix affinity needs."""

# baton: pure

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import orjson

from baton.model import RequestShape
from dataplane.responses.request import messages_of
from dataplane.spec.plan import sets_temperature, spec_eligible
from dataplane.validate import ClientRequest, Endpoint

DEFAULT_KEY = b"baton-prefix-v1"
DIGEST_SIZE = 16


HASHED_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def canonical(message: Any) -> bytes:
    """A message as the model sees it, so that the assistant turn a client echoes back
    (as a plain dict, or an SDK object dumped with None fields) hashes like the reply we
    pinned: key order, empty fields and text-part splitting don't change the hash."""
    if not isinstance(message, dict):
        return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
    kept = {k: message[k] for k in HASHED_KEYS if message.get(k) not in (None, "", [])}
    content = kept.get("content")
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        kept["content"] = "".join(str(p.get("text", "")) for p in content)
    return orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)


def prefix_chain(messages: list[Any], key: bytes = DEFAULT_KEY) -> tuple[bytes, ...]:
    chain: list[bytes] = []
    prev = b""
    for m in messages:
        prev = hashlib.blake2b(prev + canonical(m), digest_size=DIGEST_SIZE, key=key).digest()
        chain.append(prev)
    return tuple(chain)


def reply_hash(chain: tuple[bytes, ...], reply: str, key: bytes = DEFAULT_KEY) -> bytes:
    """The chain hash the next turn will carry for this assistant reply."""
    prev = chain[-1] if chain else b""
    message = {"role": "assistant", "content": reply}
    return hashlib.blake2b(prev + canonical(message), digest_size=DIGEST_SIZE, key=key).digest()


def _chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        # Non-text parts may carry "text": null (SDK dumps); only strings are text.
        return sum(
            len(t) for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str)
        )
    return 0


def shape_of(req: ClientRequest, key: bytes = DEFAULT_KEY) -> RequestShape:
    body = req.body
    if not req.endpoint.generates:
        # A one-shot call: nothing to pin, so no prefix to hash (control spreads it).
        return RequestShape(model=req.model, greedy=False, sets_temperature=False)
    if req.endpoint is Endpoint.COMPLETIONS:
        # A completion prompt is one "message" for affinity purposes.
        prompt = body["prompt"]
        messages: list[Any] = [prompt]
        turns: tuple[bool, ...] = (False,)
        chars = len(prompt) if isinstance(prompt, str | list) else 0
    else:
        # A Responses request's messages hash as a chat request's do: the same prefix warms
        # the same cache (input that is not plain messages hashes item by item).
        chat = req.endpoint is Endpoint.CHAT
        messages = body["messages"] if chat else messages_of(body) or list(body["input"])
        turns = tuple(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
        chars = sum(_chars(m.get("content")) for m in messages if isinstance(m, dict))
    return RequestShape(
        model=req.model,
        message_count=len(messages),
        prefix_chain=prefix_chain(messages, key),
        assistant_turns=turns,
        prompt_chars=chars,
        greedy=req.greedy,
        stream=req.stream,
        spec_eligible=spec_eligible(req),
        sets_temperature=sets_temperature(req),
        owner_key=body.get("previous_response_id") or "" if req.endpoint is Endpoint.RESPONSES
        else "",
    )


# A client's explicit conversation key: vLLM's `session_id` body field, or this header.
SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256


def session_of(req: ClientRequest, header: str | None) -> str:
    """The request's session key ("" when it names none, or names one too long to be one)."""
    value = req.body.get("session_id")
    key = value if isinstance(value, str) and value else (header or "")
    return key if len(key) <= MAX_SESSION_CHARS else ""


def with_session(shape: RequestShape, session: str) -> RequestShape:
    return replace(shape, session=session) if session else shape
