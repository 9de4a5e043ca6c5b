"""A tenant's standing at the edge, in OpenAI's conventions: the x-ratelimit-* headers on
every answer to a tenant with request or token limits, and the refusals control's admission
decides (403 for a model the tenant may not use, 429 with Retry-After at a limit, 401 for a
key whose tenant was removed since this shim's snapshot)."""

from __future__ import annotations

import math

from aiohttp import web

from baton.model import Decision, Reason
from baton.tenancy import Limited, Quota
from dataplane.exceptions import ErrorKind, OpenAIError

TENANT = web.RequestKey("tenant", str)  # the tenant whose key the request came with
QUOTA = web.RequestKey("quota", Quota)  # its standing, as control's admission left it
# Control's admission refused the request: for its tenant, or shed from a saturated fleet.
ADMISSION_REFUSALS = frozenset({Reason.TENANT_LIMITED, Reason.TENANT_MODEL,
                                Reason.TENANT_UNKNOWN, Reason.SHED})  # fmt: skip
SHED_RETRY_S = 1  # a request shed from a saturated fleet: retry soon, room frees continually


def duration(seconds: float) -> str:
    """As OpenAI writes a reset time: "20ms", "1s", "6m0s"."""
    if seconds < 1:
        return f"{max(math.ceil(seconds * 1000), 0)}ms"
    minutes, rest = divmod(seconds, 60)
    rest = round(rest, 3)
    return f"{int(minutes)}m{rest:g}s" if minutes else f"{rest:g}s"


def quota_headers(q: Quota) -> dict[str, str]:
    out: dict[str, str] = {}
    if q.limit_requests:
        out["x-ratelimit-limit-requests"] = str(q.limit_requests)
        out["x-ratelimit-remaining-requests"] = str(q.remaining_requests)
        out["x-ratelimit-reset-requests"] = duration(q.reset_requests_s)
    if q.limit_tokens:
        out["x-ratelimit-limit-tokens"] = str(q.limit_tokens)
        out["x-ratelimit-remaining-tokens"] = str(q.remaining_tokens)
        out["x-ratelimit-reset-tokens"] = duration(q.reset_tokens_s)
    if q.limited_by is not None:
        # Whole seconds, as HTTP says; the OpenAI SDKs read retry-after-ms first.
        out["Retry-After"] = str(max(math.ceil(q.retry_after_s), 1))
        out["retry-after-ms"] = str(max(round(q.retry_after_s * 1000), 1))
    return out


def admission_refusal(decision: Decision, model: str) -> OpenAIError:
    if decision.reason is Reason.TENANT_MODEL:
        return OpenAIError(
            ErrorKind.MODEL_NOT_ALLOWED,
            f"Your API key is not allowed to use the model `{model}`.",
            "model",
        )
    if decision.reason is Reason.TENANT_UNKNOWN:
        return OpenAIError(ErrorKind.UNAUTHORIZED, "Incorrect API key provided.")
    if decision.reason is Reason.SHED:
        return OpenAIError(
            ErrorKind.FLEET_SATURATED,
            f"The fleet is saturated ({decision.detail}); retry shortly.",
            headers={"Retry-After": str(SHED_RETRY_S), "retry-after-ms": str(SHED_RETRY_S * 1000)},
        )
    q = decision.quota or Quota(retry_after_s=1.0, limited_by=Limited.REQUESTS)
    limited = q.limited_by or Limited.REQUESTS
    return OpenAIError(
        ErrorKind.RATE_LIMITED,
        f"Rate limit reached: {decision.detail}. Please try again in "
        f"{duration(q.retry_after_s)}.",
        headers=quota_headers(q),
        error_type="tokens" if limited is Limited.TOKENS else "requests",
    )


async def add_quota_headers(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's on_response_prepare: an admitted request's answer, whichever way it is
    sent (whole, streamed, an error), says where its tenant stands."""
    q = request.get(QUOTA)
    if q is not None and q.limited_by is None:
        response.headers.update(quota_headers(q))
