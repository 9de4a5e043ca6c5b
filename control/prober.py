"""Active health probes: GET each backend's health endpoint on an interval with jitter and
feed the result to the registry (which owns the state machine)."""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp

from baton.model import PROBE_PATH, Backend
from control.config import ProbeSettings
from control.facts import Facts
from control.facts_fetch import fetch_facts, fetch_max_model_len
from control.registry import Registry


async def probe_once(session: aiohttp.ClientSession, backend: Backend, timeout: float) -> str:
    """Empty string when healthy, else why not."""
    try:
        async with session.get(
            backend.url + PROBE_PATH[backend.kind],
            headers=backend.call_headers(os.environ),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            await resp.read()
            return "" if resp.status == 200 else f"status {resp.status}"
    except TimeoutError:
        return f"timeout after {timeout:g}s"
    except aiohttp.ClientConnectorError as exc:
        return f"connect: {exc.os_error.strerror or exc.os_error}"
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}"


async def run_prober(
    registry: Registry,
    settings: ProbeSettings,
    rng: random.Random,
    session: aiohttp.ClientSession,
) -> None:
    facts = FactsRefresher(registry, session)
    while True:
        backends = [b.backend for b in registry.snapshot.backends]
        results = await asyncio.gather(
            *(probe_once(session, b, settings.timeout) for b in backends)
        )
        for backend, failure in zip(backends, results, strict=True):
            registry.probe_result(backend.id, not failure, failure)
        await facts.refresh(backends, [not f for f in results])
        jitter = settings.interval * settings.jitter * (2 * rng.random() - 1)
        await asyncio.sleep(max(0.05, settings.interval + jitter))


class FactsRefresher:
    """Pairs are re-bound only to targets whose facts match the draft's, so control keeps
    every backend's facts: read when it first answers a probe and again each time it comes
    back (a restarted replica may have another generation config). A backend without
    /server_info is asked again only after a while."""

    RETRY_S = 30.0

    def __init__(self, registry: Registry, session: aiohttp.ClientSession) -> None:
        self._registry = registry
        self._session = session
        self._was_up: dict[str, bool] = {}
        self._tried: dict[str, float] = {}

    async def refresh(self, backends: list[Backend], up: list[bool]) -> None:
        now = time.monotonic()
        due = [
            b
            for b, ok in zip(backends, up, strict=True)
            if ok
            and (
                not self._was_up.get(b.id, False)
                or (b.id not in self._registry.facts
                    and now - self._tried.get(b.id, -1e9) > self.RETRY_S)
            )
        ]  # fmt: skip
        self._was_up = {b.id: ok for b, ok in zip(backends, up, strict=True)}
        if not due:
            return
        for b in due:
            self._tried[b.id] = now
        read = await asyncio.gather(
            *(fetch_facts(self._session, b) for b in due), return_exceptions=True
        )
        lengths = await asyncio.gather(*(fetch_max_model_len(self._session, b) for b in due))
        for b, result, length in zip(due, read, lengths, strict=True):
            if isinstance(result, Facts):
                self._registry.set_facts(b.id, result)
            if length is not None:
                self._registry.set_max_model_len(b.id, length)
