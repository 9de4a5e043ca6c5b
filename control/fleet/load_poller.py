"""Reads each engine's own load gauges (control/signals/engine_load.py) from its /metrics every
`interval` seconds and hands the readings to the registry. An engine that does not answer, or whose
page lacks the gauges, has no reading: routing then counts only what Baton sent it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from control.fleet.registry import Registry
from control.settings import LoadSettings
from control.signals.engine_load import GAUGES, parse_load
from control.signals.published import fetch_metrics_page


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
            *(fetch_metrics_page(session, b, settings.timeout) for b in engines.values())
        ), strict=True))  # fmt: skip
        for b in backends:
            page = pages[b.url]
            reading = None if page is None else parse_load(page, b.kind, now, b.data_parallel_rank)
            registry.set_engine_load(b.id, reading)
        await asyncio.sleep(settings.interval)
