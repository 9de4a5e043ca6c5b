"""Pure: which upstream answers are the backend's failure (baton.model.Failure names each
class). The plumbing asks, this decides."""

# baton: pure

from __future__ import annotations

from baton.model import Failure


def classify_status(status: int) -> Failure | None:
    """A status that means "this backend, not this request, is the problem": try another.
    Other 4xx are the client's: relay them as they are."""
    if status >= 500:
        return Failure.STATUS_5XX
    if status == 429:
        return Failure.OVERLOADED
    return None
