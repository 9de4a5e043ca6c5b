"""Bearer-token check for the admin service; routing and health stay open to shims."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from control.services.errors import Context

ADMIN_PREFIX = "/baton.v1.AdminService/"
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


async def _deny(request: Any, context: Context) -> Any:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "admin token missing or wrong: set BATON_ADMIN_TOKEN to control's token",
    )


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._deny: Handler = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        if details.method.startswith(ADMIN_PREFIX):
            metadata = dict(details.invocation_metadata or ())
            given = metadata.get("authorization", "")
            given_b = given.encode() if isinstance(given, str) else given
            if not hmac.compare_digest(given_b, self._expected):
                return self._deny
        return await continuation(details)
