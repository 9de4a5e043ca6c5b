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
from control.engineload import GAUGES, parse_load
from control.registry import Registry


async def read_page(
    session: aiohttp.ClientSession, backend: Backend, timeout: float
) -> str | None:
    """The engine's /metrics page; None when it does not answer with one."""
    try:
        async with session.get(
            backend.url + "/metrics",
            headers=backend.call_headers(os.environ),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            if resp.status != 200:
                return None
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


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
        # One page per engine: the ranks of a data-parallel one share its url and its page.
        engines = {b.url: b for b in reversed(backends)}
        pages = dict(zip(engines, await asyncio.gather(
            *(read_page(session, b, settings.timeout) for b in engines.values())
        ), strict=True))  # fmt: skip
        for b in backends:
            page = pages[b.url]
            reading = None if page is None else parse_load(page, b.kind, now, b.data_parallel_rank)
            registry.set_engine_load(b.id, reading)
        await asyncio.sleep(settings.interval)
