"""Control's refusals as the client is told them: one table from a decision's reason to the
error (DESIGN §2: plumbing maps errors through one table per edge), applied once, wherever a
decision comes back with no backend (dataplane/edge/handlers.py, a stored response's
follow-up in dataplane/responses/stored.py). In OpenAI's conventions: 403 for a model the
tenant may not use, 429 with Retry-After and x-ratelimit-* headers at a limit, 429
insufficient_quota at a spend budget (a 400 on Anthropic's API), 401 for a key
whose tenant was removed since this shim's snapshot, 404s that say where a stored response
was, never a misleading "not found" from an engine that never had it."""

# baton: pure

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from baton.model import Decision, Reason
from baton.tenancy import Limited, Quota
from dataplane.exceptions import ErrorKind, OpenAIError

SHED_RETRY_S = 1  # a request shed from a saturated fleet: retry soon, room frees continually


def duration(seconds: float) -> str:
    """As OpenAI writes a reset time: "20ms", "1s", "6m0s"."""
    if seconds < 1:
        return f"{max(math.ceil(seconds * 1000), 0)}ms"
    minutes, rest = divmod(seconds, 60)
    rest = round(rest, 3)
    return f"{int(minutes)}m{rest:g}s" if minutes else f"{rest:g}s"


def quota_headers(q: Quota) -> dict[str, str]:
    """A tenant's standing in OpenAI's x-ratelimit-* headers (and Retry-After at a limit)."""
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


def _model_not_allowed(decision: Decision, model: str) -> OpenAIError:
    message = f"Your API key is not allowed to use the model `{model}`."
    return OpenAIError(ErrorKind.MODEL_NOT_ALLOWED, message, "model")


def _unknown_key(decision: Decision, model: str) -> OpenAIError:
    return OpenAIError(ErrorKind.UNAUTHORIZED, "Incorrect API key provided.")


def _shed(decision: Decision, model: str) -> OpenAIError:
    return OpenAIError(
        ErrorKind.FLEET_SATURATED,
        f"The fleet is saturated ({decision.detail}); retry shortly.",
        headers={"Retry-After": str(SHED_RETRY_S), "retry-after-ms": str(SHED_RETRY_S * 1000)},
    )


def _rate_limited(decision: Decision, model: str) -> OpenAIError:
    q = decision.quota or Quota(retry_after_s=1.0, limited_by=Limited.REQUESTS)
    limited = q.limited_by or Limited.REQUESTS
    return OpenAIError(
        ErrorKind.RATE_LIMITED,
        f"Rate limit reached: {decision.detail}. Please try again in "
        f"{duration(q.retry_after_s)}.",
        headers=quota_headers(q),
        error_type="tokens" if limited is Limited.TOKENS else "requests",
    )


def _insufficient_quota(decision: Decision, model: str) -> OpenAIError:
    """A spend budget reached: OpenAI's insufficient_quota (429), told not to retry (the
    OpenAI and Anthropic SDKs retry a 429 unless x-should-retry says false, and a retry
    before the period resets is refused again); on /v1/messages, Anthropic's answer to a
    spend limit: a 400 that says when access comes back."""
    q = decision.quota or Quota()
    anthropic = "You have reached your specified API usage limits."
    if q.reset_at:
        at = datetime.fromtimestamp(q.reset_at, UTC).strftime("%Y-%m-%d at %H:%M")
        anthropic += f" You will regain access on {at} UTC."
    return OpenAIError(
        ErrorKind.INSUFFICIENT_QUOTA,
        f"You exceeded your current quota: {decision.detail}.",
        headers={"Retry-After": str(max(math.ceil(q.retry_after_s), 1)),
                 "x-should-retry": "false"},  # fmt: skip
        anthropic_message=anthropic,
    )


def _owner_gone(decision: Decision, model: str) -> OpenAIError:
    return OpenAIError(ErrorKind.RESPONSE_OWNER_GONE,
                       f"the stored response cannot be reached: {decision.detail}")  # fmt: skip


def _owner_unknown(decision: Decision, model: str) -> OpenAIError:
    return OpenAIError(ErrorKind.RESPONSE_NOT_FOUND, decision.detail or "response not found")


def _unknown_model(decision: Decision, model: str) -> OpenAIError:
    return OpenAIError(ErrorKind.MODEL_NOT_FOUND, f"The model `{model}` does not exist.", "model")


def _no_backend(decision: Decision, model: str) -> OpenAIError:
    return OpenAIError(ErrorKind.NO_BACKEND, decision.detail or "no backend available")


# reason -> the client's error, given the decision and the request's model.
REFUSALS: Mapping[Reason, Callable[[Decision, str], OpenAIError]] = {
    # Control's admission: for the request's tenant, or shed from a saturated fleet.
    Reason.TENANT_MODEL: _model_not_allowed,
    Reason.TENANT_UNKNOWN: _unknown_key,
    Reason.TENANT_LIMITED: _rate_limited,
    Reason.TENANT_BUDGET: _insufficient_quota,
    Reason.SHED: _shed,
    # A stored response's follow-up (control/routing/router.py's owner reasons).
    Reason.OWNER_GONE: _owner_gone,
    Reason.OWNER_UNKNOWN: _owner_unknown,
    Reason.UNKNOWN_MODEL: _unknown_model,
}


def refusal(decision: Decision, model: str) -> OpenAIError:
    """The error for a decision with no backends (503 no_backend_available for a reason the
    table does not name)."""
    return REFUSALS.get(decision.reason, _no_backend)(decision, model)
