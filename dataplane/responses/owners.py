"""What a client is told when control refuses a stored response's follow-up
(control/routing/router.py's owner reasons): an OpenAI-shaped 404 that says where the response was,
never a misleading "not found" from an engine that never had it."""

# baton: pure

from __future__ import annotations

from baton.model import Decision, Reason
from dataplane.exceptions import ErrorKind, OpenAIError

OWNER_REASONS = frozenset({Reason.OWNER_GONE, Reason.OWNER_UNKNOWN})


def refused(decision: Decision) -> OpenAIError:
    """The error for an empty decision on an owner route."""
    if decision.reason is Reason.OWNER_GONE:
        return OpenAIError(
            ErrorKind.RESPONSE_OWNER_GONE,
            f"the stored response cannot be reached: {decision.detail}",
        )
    return OpenAIError(ErrorKind.RESPONSE_NOT_FOUND, decision.detail or "response not found")
