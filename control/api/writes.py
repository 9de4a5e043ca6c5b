"""AdminService's write handlers, one at a time: a change and its saving (fleet.db, or a
replica's commit to etcd) are one step, so a write undone never takes another's change with
it. What a handler raises answers the call through the one table (control/api/errors.py)
while it holds the lock; a StoreError (its commit refused) with the baton-store trailer."""

# baton: pure

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from baton.replicas import STORE_METADATA
from control.api.errors import Context, Trailing, map_errors
from control.exceptions import StoreError

_R = TypeVar("_R")


def from_store(exc: Exception) -> Trailing:
    # The store's answer (a commit etcd refused), not an unreachable replica's: clients
    # don't try another.
    return ((STORE_METADATA, "etcd"),) if isinstance(exc, StoreError) else ()


def write(
    handler: Callable[[Any, Any, Context], Awaitable[_R]],
) -> Callable[[Any, Any, Context], Awaitable[_R]]:
    """A write handler of a servicer that has `_writes` (an asyncio.Lock), run while no other
    write runs."""
    answered = map_errors(handler, trailing=from_store)

    async def serialized(self: Any, request: Any, context: Context) -> _R:
        async with self._writes:
            return await answered(self, request, context)

    serialized.__name__ = handler.__name__
    return serialized
