"""How a request ended, as control hears it: every RequestOutcome the shim sends is built
here (the proxy's, the speculative server's, a stored response's follow-up, a request no
backend served or whose client left), so each field means the same wherever it comes from."""

# baton: pure

from __future__ import annotations

from baton.model import PrefixBlocks, RequestOutcome, RequestShape, SpecStats
from dataplane.prefix_chain import reply_hash

CLIENT_GONE = 499  # the client went away before its answer: nginx's status, as logs say it
UNSERVED = 502  # no backend served it (each attempt's failure was reported on its own)


def outcome(
    request_id: str,
    backend_id: str,
    model: str,
    status: int,
    *,
    ok: bool | None = None,
    shape: RequestShape | None = None,
    started: float | None = None,
    first_byte: float | None = None,
    now: float | None = None,
    reply: str | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    blocks: PrefixBlocks | None = None,
    spec: SpecStats | None = None,
    cached_tokens: int = 0,
) -> RequestOutcome:
    """`ok`: whether it counts as served (default: a status under 400). `started`,
    `first_byte`, `now`: monotonic times, for the time to first byte (`now` when none came)
    and in all. `reply`: the assistant's text, to pin the next turn's prefix where it was
    served (chat only: None otherwise); it needs `shape`, whose message count goes too."""
    ttft_ms = total_ms = 0.0
    if started is not None and now is not None:
        ttft_ms = ((first_byte or now) - started) * 1000
        total_ms = (now - started) * 1000
    chain = b""
    if reply is not None and shape is not None:
        chain = reply_hash(shape.prefix_chain, reply)
    return RequestOutcome(
        request_id=request_id,
        backend_id=backend_id,
        model=model,
        ok=status < 400 if ok is None else ok,
        http_status=status,
        ttft_ms=ttft_ms,
        total_ms=total_ms,
        reply_chain_hash=chain,
        message_count=shape.message_count if shape is not None else 0,
        spec=spec,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        blocks=blocks,
        cached_tokens=cached_tokens,
        tenant=shape.tenant if shape is not None else "",
    )


def cached_count(usage: object) -> int:
    """Prompt tokens the engine had cached, as its usage says them (OpenAI's
    prompt_tokens_details.cached_tokens; 0 where it says none): priced apart."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if type(n) is int and n > 0 else 0
