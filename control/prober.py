"""Active health probes: GET each backend's health endpoint on an interval with jitter and
feed the result to the registry (which owns the state machine)."""

from __future__ import annotations

import asyncio
import random

import aiohttp

from control.config import ProbeSettings
from control.model import Backend, BackendKind
from control.registry import Registry

PROBE_PATH = {
    BackendKind.VLLM: "/health",
    BackendKind.SGLANG: "/health",
    # A generic OpenAI-compatible server need not have /health; /v1/models is in the API.
    BackendKind.OPENAI: "/v1/models",
}


async def probe_once(session: aiohttp.ClientSession, backend: Backend, timeout: float) -> str:
    """Empty string when healthy, else why not."""
    try:
        async with session.get(
            backend.url + PROBE_PATH[backend.kind], timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            await resp.read()
            return "" if resp.status == 200 else f"status {resp.status}"
    except TimeoutError:
        return f"timeout after {timeout:g}s"
    except aiohttp.ClientConnectorError as exc:
        return f"connect: {exc.os_error.strerror or exc.os_error}"
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}"


async def run_prober(registry: Registry, settings: ProbeSettings, rng: random.Random) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            backends = [b.backend for b in registry.snapshot.backends]
            results = await asyncio.gather(
                *(probe_once(session, b, settings.timeout) for b in backends)
            )
            for backend, failure in zip(backends, results, strict=True):
                registry.probe_result(backend.id, not failure, failure)
            jitter = settings.interval * settings.jitter * (2 * rng.random() - 1)
            await asyncio.sleep(max(0.05, settings.interval + jitter))
