"""Pure: a request's shape for control — sizes and keyed hashes (dataplane/prefix_chain.py),
never prompt text."""

# baton: pure

from __future__ import annotations

from dataclasses import replace
from typing import Any

from baton.model import RequestShape
from dataplane.messages.request import hashed_messages
from dataplane.prefix_chain import DEFAULT_KEY, prefix_chain
from dataplane.request import ClientRequest, Endpoint, token_limit
from dataplane.responses.request import messages_of
from dataplane.spec.plan import sets_temperature, spec_eligible


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
        if req.endpoint is Endpoint.CHAT:
            messages = body["messages"]
        elif req.endpoint is Endpoint.MESSAGES:
            messages = hashed_messages(body)  # as chat's, where Baton can convert them
        else:
            messages = messages_of(body) or list(body["input"])
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
        max_tokens=_output_cap(req),
    )


MAX_TOKENS_SENT = 2**32 - 1  # RequestShape.max_tokens is a uint32


def _output_cap(req: ClientRequest) -> int:
    """The client's cap on generated tokens, reserved against its tenant's tokens per
    minute (0: none given). Validated bodies hold ints >= 1 where they hold one."""
    cap = token_limit(req.body)
    if cap is None and req.endpoint is Endpoint.RESPONSES:
        cap = req.body.get("max_output_tokens")
    if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
        return 0
    return min(cap, MAX_TOKENS_SENT)  # the engine refuses a cap past its context anyway


# A client's explicit conversation key: vLLM's `session_id` body field, or this header.
SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256


def session_of(req: ClientRequest, header: str | None) -> str:
    """The request's session key ("" when it names none, or names one too long to be one)."""
    value = req.body.get("session_id")
    key = value if isinstance(value, str) and value else (header or "")
    return key if len(key) <= MAX_SESSION_CHARS else ""


def with_request(shape: RequestShape, session: str, tenant: str) -> RequestShape:
    """The shape with what the client's request says beside its body: its session header's
    key and the tenant its API key belongs to."""
    return replace(shape, session=session, tenant=tenant) if session or tenant else shape
