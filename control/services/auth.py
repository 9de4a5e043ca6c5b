"""Bearer-token check for the admin service; routing and health stay open to shims."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

ADMIN_PREFIX = "/baton.v1.AdminService/"


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "admin token missing or wrong: set BATON_ADMIN_TOKEN to control's token",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(ADMIN_PREFIX):
            metadata = dict(details.invocation_metadata or ())
            given = metadata.get("authorization", "")
            given_b = given.encode() if isinstance(given, str) else given
            if not hmac.compare_digest(given_b, self._expected):
                return self._deny
        return await continuation(details)
