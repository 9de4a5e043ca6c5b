"""Pure: classify upstream failures and bound retries. The plumbing asks, this decides."""

# baton: pure

from __future__ import annotations

from enum import StrEnum


class Failure(StrEnum):
    CONNECT = "connect"  # refused, unreachable, DNS: nothing was sent
    DISCONNECT = "disconnect"  # the connection closed before a response status arrived
    TIMEOUT = "timeout"
    STATUS_5XX = "status_5xx"
    OVERLOADED = "status_429"
    TRUNCATED = "truncated"  # stream ended before [DONE]
    ERROR_EVENT = "error_event"  # an in-band error chunk on a 200 stream
    STALL = "stall"  # no chunk within the first-token / inter-token timeout
    GARBAGE = "garbage"  # an event that is not the JSON we expect
    # A resume answered 4xx: the backend refused this request, which says nothing about
    # its health, so it is skipped but never demoted.
    REJECTED = "status_4xx"
    # The engine ended a choice with finish_reason "abort" or "error": the text up to there
    # is real, the finish is the engine's failure.
    FINISH_ABORT = "finish_abort"
    FINISH_ERROR = "finish_error"
    # A resume that cannot be faithful (guided output, a tool call in flight...): not the
    # backend's fault either.
    REFUSED = "refused"
    # Not a failure: the backend was drained with --migrate and its streams move elsewhere.
    MIGRATE = "migrate"

    @classmethod
    def finish(cls, reason: str) -> Failure:
        """The failure a failed finish_reason ("abort", "error") stands for."""
        return cls(f"finish_{reason}")


def classify_status(status: int) -> Failure | None:
    """A status that means "this backend, not this request, is the problem": try another.
    Other 4xx are the client's: relay them as they are."""
    if status >= 500:
        return Failure.STATUS_5XX
    if status == 429:
        return Failure.OVERLOADED
    return None
