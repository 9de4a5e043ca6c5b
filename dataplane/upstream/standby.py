"""Standby connections for resumes. A failover's resume is the one request whose latency
the client sees as a hole in its stream, and opening a connection costs a handshake plus
several event-loop turns (0.4 ms on an idle shim, 5-15 ms measured on the failover bench's
loaded 2-core fleet, where it was a quarter of all resumes). Resumes therefore get a
connection pool of their own, in which this keeps `spare` connections open to every backend
a stream may resume on: that many concurrent cheap GETs (the path control probes) per
backend, more often than the pool's keep-alive expiry. Like Envoy's preconnect: a resume
takes a connection that is already there."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence

import aiohttp

from baton.model import PROBE_PATH, Backend


class Standby:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        backends: Callable[[], Sequence[Backend]],
        spare: int,
        every: float,
    ) -> None:
        """`session`: the resumes' own; `backends`: where a resume may go, asked each round;
        `every`: seconds between rounds, below the session's keep-alive expiry."""
        self._session = session
        self._backends = backends
        self._spare = spare
        self._every = every

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            await asyncio.gather(*(self._touch(b) for b in self._backends()))
            await asyncio.sleep(self._every)

    async def _touch(self, backend: Backend) -> None:
        # Concurrent: each GET takes an idle connection or opens one, and all of them go
        # back to the pool when answered.
        await asyncio.gather(*(self._get(backend) for _ in range(self._spare)))

    async def _get(self, backend: Backend) -> None:
        # Any answer will do (its status is control's business); a failure costs nothing.
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self._session.get(
                backend.url + PROBE_PATH[backend.kind],
                headers=backend.call_headers(os.environ),
                timeout=aiohttp.ClientTimeout(total=self._every),
            ) as resp:
                await resp.read()
