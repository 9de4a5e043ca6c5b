"""One table from domain exceptions to gRPC status codes for the control plane's edge."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc

from control.exceptions import (
    AdapterNotFound,
    AdapterRefused,
    BackendExists,
    BackendNotFound,
    ConfigError,
    NotLeader,
    PairExists,
    PairNotFound,
    PairRefused,
    PriceNotFound,
    StoreConflict,
    StoreUnavailable,
    TenantExists,
    TenantNotFound,
)

# grpc's stubs make the context generic; servicers here handle many message types.
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Trailing: TypeAlias = tuple[tuple[str, str], ...]

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
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (PriceNotFound, grpc.StatusCode.NOT_FOUND),
    (AdapterRefused, grpc.StatusCode.FAILED_PRECONDITION),
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


async def abort_with(context: Context, exc: Exception, trailing: Trailing = ()) -> NoReturn:
    """Ends the call with `exc`'s status from the table, or raises `exc` when the table has
    none (the caller sees UNKNOWN). Never returns: grpc.aio's abort raises."""
    code = status_for(exc)
    if code is None:
        raise exc
    if trailing:
        await context.abort(code, str(exc), trailing)
    else:
        await context.abort(code, str(exc))


def no_trailing(exc: Exception) -> Trailing:
    return ()


_S = TypeVar("_S")
_Q = TypeVar("_Q")
_R = TypeVar("_R")


def map_errors(
    handler: Callable[[_S, _Q, Context], Awaitable[_R]],
    *,
    trailing: Callable[[Exception], Trailing] = no_trailing,
) -> Callable[[_S, _Q, Context], Awaitable[_R]]:
    """A servicer method whose exceptions answer the call through the table once, as httpx's
    map_exceptions does: one in STATUS_FOR ends the call with its status, its message as the
    details and `trailing(exc)` as trailing metadata; any other propagates (UNKNOWN)."""

    @functools.wraps(handler)
    async def mapped(self: _S, request: _Q, context: Context) -> _R:
        try:
            return await handler(self, request, context)
        except Exception as exc:
            await abort_with(context, exc, trailing(exc))

    return mapped
