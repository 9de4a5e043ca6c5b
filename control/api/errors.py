"""One table from domain exceptions to gRPC status codes for the control plane's edge."""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc

from control.exceptions import (
    BackendExists,
    BackendNotFound,
    ConfigError,
    PairExists,
    PairNotFound,
    PairRefused,
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
)


def status_for(exc: Exception) -> grpc.StatusCode | None:
    for cls, code in STATUS_FOR:
        if isinstance(exc, cls):
            return code
    return None


async def abort_with(context: Context, exc: Exception) -> None:
    code = status_for(exc)
    if code is None:
        raise exc
    await context.abort(code, str(exc))
