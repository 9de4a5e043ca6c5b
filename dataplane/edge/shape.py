"""Pure: a request's shape for control — sizes and keyed hashes (dataplane/prefix_chain.py),
never prompt text. What each API hashes and caps is its own (dataplane/apis/)."""

# baton: pure

from __future__ import annotations

from dataclasses import replace

from baton.model import RequestShape
from dataplane.apis.table import APIS
from dataplane.prefix_chain import DEFAULT_KEY, prefix_chain
from dataplane.request import ClientRequest
from dataplane.spec.plan import sets_temperature, spec_eligible


def shape_of(req: ClientRequest, key: bytes = DEFAULT_KEY) -> RequestShape:
    if not req.endpoint.generates:
        # A one-shot call: nothing to pin, so no prefix to hash (control spreads it).
        return RequestShape(model=req.model, greedy=False, sets_temperature=False)
    api = APIS[req.endpoint]
    prompt = api.prompt(req.body)
    return RequestShape(
        model=req.model,
        message_count=len(prompt.messages),
        prefix_chain=prefix_chain(prompt.messages, key),
        assistant_turns=prompt.turns,
        prompt_chars=prompt.chars,
        greedy=req.greedy,
        stream=req.stream,
        spec_eligible=spec_eligible(req),
        sets_temperature=sets_temperature(req),
        owner_key=api.owner_key(req.body),
        max_tokens=_output_cap(api.output_cap(req.body)),
    )


MAX_TOKENS_SENT = 2**32 - 1  # RequestShape.max_tokens is a uint32


def _output_cap(cap: int | None) -> int:
    """The client's cap on generated tokens, reserved against its tenant's tokens per
    minute (0: none given)."""
    if cap is None or cap <= 0:
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
