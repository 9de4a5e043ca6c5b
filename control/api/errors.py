"""One table from domain exceptions to gRPC status codes for the control plane's edge."""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc

from control.exceptions import (
    BackendExists,
    BackendNotFound,
    ConfigError,
    NotLeader,
    PairExists,
    PairNotFound,
    PairRefused,
    StoreConflict,
    StoreUnavailable,
    TenantExists,
    TenantNotFound,
)

# grpc's stubs make the context generic; servicers here handle many message types.
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

STATUS_FOR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (BackendNotFound, grpc.StatusCode.NOT_FOUND),
    (BackendExists, grpc.StatusCode.ALREADY_EXISTS),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (PairNotFound, grpc.StatusCode.NOT_FOUND),
    (PairExists, grpc.StatusCode.ALREADY_EXISTS),
    # A pairing that breaks an invariant: the message names it (tokenizer, block_size, ...).
    (PairRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (TenantExists, grpc.StatusCode.ALREADY_EXISTS),
    (TenantNotFound, grpc.StatusCode.NOT_FOUND),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (NotLeader, grpc.StatusCode.FAILED_PRECONDITION),
    (StoreConflict, grpc.StatusCode.ABORTED),
)


NO_DEADLINE_S = 30.0  # how long a call without a deadline may spend reading an engine
# Kept back from a deadline so that a refusal still reaches the caller: a tenth of what is
# left, at most half a second (a shim's gate call has a fraction of a second in all).
ANSWER_MARGIN = 0.1
ANSWER_MARGIN_MAX_S = 0.5


def within(context: Context) -> float:
    """Seconds this call may spend waiting on engines: its caller's deadline less the time
    to answer, so a slow engine is refused by name rather than cut off by the deadline."""
    left = context.time_remaining()
    if left is None:
        return NO_DEADLINE_S
    return max(0.001, left - min(left * ANSWER_MARGIN, ANSWER_MARGIN_MAX_S))


def status_for(exc: Exception) -> grpc.StatusCode | None:
    for cls, code in STATUS_FOR:
        if isinstance(exc, cls):
            return code
    return None


async def abort_with(
    context: Context, exc: Exception, trailing: tuple[tuple[str, str], ...] = ()
) -> None:
    code = status_for(exc)
    if code is None:
        raise exc
    if trailing:
        await context.abort(code, str(exc), trailing)
    else:
        await context.abort(code, str(exc))
