"""Bearer tokens per service: the admin token for AdminService, the shim token for
RoutingService (reports from it demote backends, fill the audit log and gate pairs, so only
shims may call it). Health and reflection stay open: they change nothing."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from baton.tokens import ADMIN_ENV, SHIM_ENV
from control.api.errors import Context

ADMIN_PREFIX = "/baton.v1.AdminService/"
ROUTING_PREFIX = "/baton.v1.RoutingService/"
REPLICA_PREFIX = "/baton.v1.ReplicaService/"
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"



def denial(
    message: str,
    like: Handler,
    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
    trailing: tuple[tuple[str, str], ...] = (),
) -> Handler:
    """A handler of the same shape as the one refused, that aborts before reading a request:
    the service's code never runs, so nothing changes."""

    async def unary(request: Any, context: Context) -> Any:
        await context.abort(code, message, trailing)

    async def streaming(request: Any, context: Context) -> AsyncIterator[Any]:
        await context.abort(code, message, trailing)
        yield  # pragma: no cover - abort raises; this only makes it a generator

    respond = streaming if like.response_streaming else unary
    if like.request_streaming and like.response_streaming:
        return grpc.stream_stream_rpc_method_handler(respond)
    if like.request_streaming:
        return grpc.stream_unary_rpc_method_handler(respond)
    if like.response_streaming:
        return grpc.unary_stream_rpc_method_handler(respond)
    return grpc.unary_unary_rpc_method_handler(respond)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """`tokens`: method prefix -> (expected token, what to tell a caller without it).
    Services not named are open."""

    def __init__(self, tokens: dict[str, tuple[str, str]]) -> None:
        self._rules = [
            (prefix, f"Bearer {token}".encode(), message)
            for prefix, (token, message) in tokens.items()
        ]

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        for prefix, expected, message in self._rules:
            if not details.method.startswith(prefix):
                continue
            metadata = dict(details.invocation_metadata or ())
            given = metadata.get("authorization", "")
            given_b = given.encode() if isinstance(given, str) else given
            if hmac.compare_digest(given_b, expected):
                break
            handler = await continuation(details)
            return None if handler is None else denial(message, handler)
        return await continuation(details)


def interceptors(admin_token: str | None, shim_token: str | None) -> list[TokenInterceptor]:
    tokens: dict[str, tuple[str, str]] = {}
    if admin_token:
        tokens[ADMIN_PREFIX] = (
            admin_token,
            f"admin token missing or wrong: set {ADMIN_ENV} to control's token",
        )
    if shim_token:
        tokens[ROUTING_PREFIX] = (
            shim_token,
            f"shim token missing or wrong: only shims may call the routing service; "
            f"give the shim control's token ({SHIM_ENV} or --shim-token-file)",
        )
        # Control replicas follow their leader's soft state with the same token.
        tokens[REPLICA_PREFIX] = (
            shim_token,
            f"shim token missing or wrong: give every control replica the same token "
            f"({SHIM_ENV} or --shim-token-file)",
        )
    return [TokenInterceptor(tokens)] if tokens else []
