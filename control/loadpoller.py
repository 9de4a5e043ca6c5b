"""Reads each engine's own load gauges (engineload.py) from its /metrics every `interval`
seconds and hands the readings to the registry. An engine that does not answer, or whose page
lacks the gauges, has no reading: routing then counts only what Baton sent it."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import aiohttp

from baton.model import Backend
from control.config import LoadSettings
from control.engineload import GAUGES, EngineLoad, parse_load
from control.registry import Registry


async def read_load(
    session: aiohttp.ClientSession, backend: Backend, timeout: float, now: float
) -> EngineLoad | None:
    try:
        async with session.get(
            backend.url + "/metrics",
            headers=backend.auth_headers(os.environ),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None
    return parse_load(text, backend.kind, now)


async def run_load_poller(
    registry: Registry,
    settings: LoadSettings,
    session: aiohttp.ClientSession,
    clock: Callable[[], float] = time.time,
) -> None:
    """`clock`: the router's, which judges a reading's age."""
    while True:
        backends = [s.backend for s in registry.snapshot.backends if s.backend.kind in GAUGES]
        now = clock()
        readings = await asyncio.gather(
            *(read_load(session, b, settings.timeout, now) for b in backends)
        )
        for backend, reading in zip(backends, readings, strict=True):
            registry.set_engine_load(backend.id, reading)
        await asyncio.sleep(settings.interval)
