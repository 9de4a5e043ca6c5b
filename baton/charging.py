"""What a tenant's budgets make of one request: its estimated cost at admission, the answer
when a budget refuses it, and its cost at its end. Control's admission and a shim's own
(while control is away) both charge through these, so a request costs the same on either."""

# baton: pure

from __future__ import annotations

from baton.budgets import Refusal
from baton.ledger import Admission
from baton.model import Reason
from baton.pricing import PriceTable
from baton.tenancy import Limited, Quota


def estimate(prices: PriceTable, model: str, tokens: int, output_tokens: int) -> int:
    """Units a request may cost before the engine says. `tokens` is admission's estimate
    (the prompt from its characters, plus max_tokens), `output_tokens` the max_tokens in it:
    the two are priced apart (input and output prices differ by 4 to 8 times)."""
    output = min(max(output_tokens, 0), max(tokens, 0))
    return prices.estimate(model, tokens - output, output)


def over_budget(refusal: Refusal, now: float) -> Admission:
    """A budget's refusal as admission answers it: the quota says when the period resets
    (Retry-After, and the reset time the client is told)."""
    quota = Quota(retry_after_s=refusal.retry_after_s(now), limited_by=Limited.BUDGET,
                  reset_at=float(refusal.standing.reset_at))  # fmt: skip
    return Admission(Reason.TENANT_BUDGET, refusal.detail, quota, Limited.BUDGET)


def cost(
    prices: PriceTable,
    model: str,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    *,
    generated: bool,
) -> int | None:
    """Units a request that ended cost, from the engine's usage. `generated`: a backend took
    it and did not refuse it (an engine's 4xx, a request no backend served, a client gone
    before its route: 0). None: it was served but its usage is unknown (a client gone
    mid-stream, an engine that died): its estimate stands."""
    if not generated:
        return 0
    if prompt_tokens <= 0 and completion_tokens <= 0:
        return None
    return prices.cost(model, prompt_tokens, cached_tokens, completion_tokens)
