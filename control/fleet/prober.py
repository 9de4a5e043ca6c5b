"""Active health probes: GET each backend's health endpoint on an interval with jitter and
feed the result to the registry (which owns the state machine)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from baton.model import PROBE_PATH, Backend
from control.fleet.registry import Registry
from control.settings import ProbeSettings
from control.signals.engine_load import engine_ranks
from control.signals.facts import Facts
from control.signals.published import fetch_facts, fetch_max_model_len, fetch_metrics_page


@dataclass(frozen=True, slots=True)
class ProbeFailure:
    reason: str
    slow: bool = False  # it timed out: the engine may only be busy (HealthPolicy.slow_after)


async def probe_once(
    session: aiohttp.ClientSession, backend: Backend, timeout: float
) -> ProbeFailure | None:
    """None when healthy, else why not."""
    try:
        async with session.get(
            backend.url + PROBE_PATH[backend.kind],
            headers=backend.call_headers(os.environ),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            await resp.read()
            return None if resp.status == 200 else ProbeFailure(f"status {resp.status}")
    except TimeoutError:
        return ProbeFailure(f"timeout after {timeout:g}s", slow=True)
    except aiohttp.ClientConnectorError as exc:
        return ProbeFailure(f"connect: {exc.os_error.strerror or exc.os_error}")
    except aiohttp.ClientError as exc:
        return ProbeFailure(f"{type(exc).__name__}")


async def run_prober(
    registry: Registry,
    settings: ProbeSettings,
    rng: random.Random,
    session: aiohttp.ClientSession,
    wants_facts: Callable[[Backend], bool] = lambda _: True,
) -> None:
    facts = FactsRefresher(registry, session, wants_facts)
    ranks = RankCheck(session)
    while True:
        backends = [b.backend for b in registry.snapshot.backends]
        results = await asyncio.gather(
            *(probe_once(session, b, settings.timeout) for b in backends)
        )
        results = await ranks.check(backends, results, settings.timeout)
        for backend, failure in zip(backends, results, strict=True):
            if failure is None:
                registry.probe_result(backend.id, True)
            else:
                registry.probe_result(backend.id, False, failure.reason, slow=failure.slow)
        await facts.refresh(backends, [f is None for f in results])
        jitter = settings.interval * settings.jitter * (2 * rng.random() - 1)
        await asyncio.sleep(max(0.05, settings.interval + jitter))


class RankCheck:
    """A data-parallel rank the engine does not run would fail every request with vLLM's 400
    ("data_parallel_rank R is out of range"): such a backend fails its probe instead, with the
    ranks the engine does run. Checked on its engine's /metrics page each time it comes up
    (an engine restarted with fewer ranks is caught), not on every probe."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        self._runs: set[str] = set()  # ranked backends whose rank the engine was seen to run

    async def check(
        self, backends: list[Backend], failures: list[ProbeFailure | None], timeout: float
    ) -> list[ProbeFailure | None]:
        """`failures` with one added for each backend up whose rank the engine lacks."""
        due = [i for i, (b, f) in enumerate(zip(backends, failures, strict=True))
               if f is None and b.data_parallel_rank is not None
               and b.id not in self._runs]  # fmt: skip
        self._runs &= {b.id for b, f in zip(backends, failures, strict=True) if f is None}
        pages = await asyncio.gather(
            *(fetch_metrics_page(self._session, backends[i], timeout) for i in due)
        )
        out = list(failures)
        for i, page in zip(due, pages, strict=True):
            b = backends[i]
            ranks = engine_ranks(page, b.kind) if page is not None else frozenset()
            if not ranks or b.data_parallel_rank in ranks:
                self._runs.add(b.id)  # it runs it, or its page cannot say: trust the config
                continue
            out[i] = ProbeFailure(f"data_parallel_rank {b.data_parallel_rank}: the engine "
                                  f"runs ranks {', '.join(map(str, sorted(ranks)))}")  # fmt: skip
        return out


class FactsRefresher:
    """Pairs are re-bound only to targets whose facts match the draft's, so control keeps
    every backend's facts: read when it first answers a probe and again each time it comes
    back (a restarted replica may have another tokenizer or block size). A backend that
    cannot tell them is asked again only after a while."""

    RETRY_S = 30.0
    # The probe loop waits for the reads (so a rejoining backend's facts are fresh before
    # its second good probe readmits it): a hung engine may hold every probe up this long.
    READ_S = 5.0

    def __init__(
        self,
        registry: Registry,
        session: aiohttp.ClientSession,
        wanted: Callable[[Backend], bool],
    ) -> None:
        self._registry = registry
        self._session = session
        # Reading facts costs the engine a vocabulary sweep: only backends a pair may need
        # are read.
        self._wanted = wanted
        self._was_up: dict[str, bool] = {}
        self._tried: dict[str, float] = {}  # when each backend's facts were last read
        self._asked: dict[str, float] = {}  # when each one's context length was last asked
        self._lengths: set[str] = set()  # backends whose context length is known

    async def refresh(self, backends: list[Backend], up: list[bool]) -> None:
        now = time.monotonic()
        answering = [b for b, ok in zip(backends, up, strict=True) if ok]
        rejoined = [b for b in answering if not self._was_up.get(b.id, False)]
        # A context length the engine did not say is asked again after a while too.
        ask_length = [b for b in answering if b in rejoined or (
            b.id not in self._lengths and now - self._asked.get(b.id, -1e9) > self.RETRY_S)]
        due = [
            b
            for b in answering
            if self._wanted(b)
            and (b in rejoined
                 or (b.id not in self._registry.facts
                     and now - self._tried.get(b.id, -1e9) > self.RETRY_S))
        ]  # fmt: skip
        self._was_up = {b.id: ok for b, ok in zip(backends, up, strict=True)}
        for b in rejoined:
            if not self._wanted(b):
                self._registry.forget_facts(b.id)  # a pair wanting it later reads it anew
        for b in due:
            self._tried[b.id] = now
        for b in ask_length:
            self._asked[b.id] = now
        read, lengths = await asyncio.gather(
            asyncio.gather(*(fetch_facts(self._session, b, self.READ_S) for b in due),
                           return_exceptions=True),  # fmt: skip
            asyncio.gather(*(fetch_max_model_len(self._session, b) for b in ask_length)),
        )
        for b, result in zip(due, read, strict=True):
            if isinstance(result, Facts):
                self._registry.set_facts(b.id, result)
            else:
                self._registry.forget_facts(b.id)
        for b, length in zip(ask_length, lengths, strict=True):
            if length is not None:
                self._lengths.add(b.id)
                self._registry.set_max_model_len(b.id, length)
