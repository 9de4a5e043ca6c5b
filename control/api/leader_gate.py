"""Only the leading replica routes and takes admin calls (control/replicas/): on any other,
every RoutingService, AdminService and ReplicaService call is refused before its code runs,
with FAILED_PRECONDITION naming the leader, and the leader's address in the `baton-leader`
trailer so that shims and the CLI go there (GetStatus is answered by every replica: it says
who leads). Streams already open when a leader stops leading are ended by their servicers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from baton.replicas import LEADER_METADATA
from control.api.auth import ADMIN_PREFIX, REPLICA_PREFIX, ROUTING_PREFIX, Handler, denial

GATED = (ROUTING_PREFIX, ADMIN_PREFIX, REPLICA_PREFIX)
OPEN = frozenset({ADMIN_PREFIX + "GetStatus"})


class Leadership(Protocol):
    @property
    def leading(self) -> bool: ...

    def refusal(self) -> tuple[str, str]:
        """(why this replica refuses, the leader's address or "")."""
        ...


class Replica(Leadership, Protocol):
    """What the routing service asks of a replica beyond its role: that what a shim reports
    is in the store before the shim is answered."""

    async def sync(self) -> None:
        """The events recorded so far are in the store (or the store does not answer)."""
        ...

    async def own(self, key: str, backend_id: str, model: str, released: bool) -> None:
        """A stored response's owner (or its release) is in the store."""
        ...


class Standalone:
    """The replica a control that is no replica stands for (the null one): it always leads,
    and there is no store to wait for, so what a shim reports is kept once it is recorded."""

    @property
    def leading(self) -> bool:
        return True

    def refusal(self) -> tuple[str, str]:
        return "", ""  # never asked: it leads

    async def sync(self) -> None:
        return None

    async def own(self, key: str, backend_id: str, model: str, released: bool) -> None:
        return None


STANDALONE = Standalone()


def trailer(leader: str) -> tuple[tuple[str, str], ...]:
    return ((LEADER_METADATA, leader),) if leader else ()


class LeaderGate(grpc.aio.ServerInterceptor):
    def __init__(self, leadership: Leadership) -> None:
        self._leadership = leadership

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        if handler is None or self._leadership.leading or details.method in OPEN:
            return handler
        if not details.method.startswith(GATED):
            return handler
        why, leader = self._leadership.refusal()
        return denial(why, handler, grpc.StatusCode.FAILED_PRECONDITION, trailer(leader))
