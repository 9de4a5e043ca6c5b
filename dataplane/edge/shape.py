"""Pure: a request's shape for control — sizes and keyed hashes (dataplane/prefix_chain.py),
never prompt text. What each API hashes and caps is its own (dataplane/apis/).

A request whose model is a LoRA adapter (as the shim's snapshot knows it: `adapter_of`) has
its prefix chain rooted at the adapter and its session key scoped to it: an engine holds a
conversation's KV cache per adapter, so pins, sessions and the blocks a prefix implies are
per adapter too. A base model's request hashes and keys exactly as it always has."""

# baton: pure

from __future__ import annotations

from dataclasses import replace

from baton.model import RequestShape, Snapshot
from dataplane.apis.table import APIS
from dataplane.prefix_chain import DEFAULT_KEY, chain_root, prefix_chain
from dataplane.request import ClientRequest
from dataplane.spec.plan import sets_temperature, spec_eligible


def adapter_of(snapshot: Snapshot, model: str) -> str | None:
    """The LoRA adapter `model` names, if the snapshot knows it as one (None: a base model,
    or a name control has not published an adapter for)."""
    adapter = snapshot.adapter(model) if snapshot.adapters else None
    return adapter.name if adapter is not None else None


def shape_of(
    req: ClientRequest, key: bytes = DEFAULT_KEY, adapter: str | None = None
) -> RequestShape:
    """`adapter`: the LoRA adapter the request names (adapter_of), None for a base model."""
    if not req.endpoint.generates:
        # A one-shot call: nothing to pin, so no prefix to hash (control spreads it).
        return RequestShape(model=req.model, greedy=False, sets_temperature=False)
    api = APIS[req.endpoint]
    prompt = api.prompt(req.body)
    return RequestShape(
        model=req.model,
        message_count=len(prompt.messages),
        prefix_chain=prefix_chain(prompt.messages, key, chain_root(adapter, key)),
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


def session_key(session: str, adapter: str | None) -> str:
    """The key control pins a session by: the client's own for a base model; for an adapter,
    scoped to it ("lora:<adapter>:<session>", as `baton pins list` shows it), since a replica
    holds a conversation's KV cache under one adapter only, so a client that reuses a
    session id across adapters gets a pin for each rather than one that drags the second
    adapter's turns to where the first one's cache is. (A base session literally named that
    way shares the pin: a hint only, and the client's own doing.)"""
    return f"lora:{adapter}:{session}" if session and adapter else session


def with_request(
    shape: RequestShape, session: str, tenant: str, adapter: str | None = None
) -> RequestShape:
    """The shape with what the client's request says beside its body: its session header's
    key (per adapter: session_key) and the tenant its API key belongs to."""
    if not (session or tenant):
        return shape
    return replace(shape, session=session_key(session, adapter), tenant=tenant)
