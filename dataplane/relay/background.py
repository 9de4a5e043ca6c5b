"""The shim's work that outlives the request that started it: a seam check whose verdict comes
after its stream ended, control's late answer to a failover already acted on, the settling of
finished upstream connections. One owner per process: the event loop keeps only weak
references to tasks, so a task nobody holds can vanish mid-flight, and this is where they are
all held until done (and where a test can see that none is left)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(
        self, work: Awaitable[T], done: Callable[[asyncio.Future[T]], None] | None = None
    ) -> asyncio.Future[T]:
        """Run `work` (a coroutine, or a task already running) until it ends; `done` is
        called then, whatever the end (a result, an exception, a cancellation)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)

        def finished(t: asyncio.Future[T]) -> None:
            self._tasks.discard(t)
            if done is not None:
                done(t)

        task.add_done_callback(finished)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def settled(self) -> None:
        """Returns once nothing is running, including work spawned by work that ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
