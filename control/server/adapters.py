"""Control's hands on the engines' LoRA adapters (issue 42): the loads the router orders
(control/routing/adapter_flow.py), an operator's loads and unloads (`baton adapters`), and a
periodic read of what each engine holds. Plumbing: what is decided is the router's and the
adapter book's; this only calls vLLM's runtime endpoints (VLLM_ALLOW_RUNTIME_LORA_UPDATING on
the engine) and reports what they answered.

- `POST /v1/load_lora_adapter {lora_name, lora_path}`: 200 when loaded; 400 "has already been
  loaded" means it is held (someone else loaded it), so it counts as loaded;
- `POST /v1/unload_lora_adapter {lora_name}`: 200; 404 when the engine does not hold it, which
  leaves it unheld all the same.

One load per (backend, adapter) at a time: the router's single flight (Residency.begin_load)
and, for an operator's load, the same task awaited."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import aiohttp

from baton.model import Adapter, BackendId, Snapshot
from control.audit.payloads import AdapterChange
from control.fleet.registry import Registry
from control.metrics import ControlMetrics
from control.routing.adapter_flow import LoadOrder, LoadResult
from control.routing.adapters import PlaceReason
from control.routing.router import Router
from control.settings import LoraSettings
from control.signals.adapters import fetch_adapters

log = logging.getLogger("baton.control.adapters")


class AdapterService:
    def __init__(
        self,
        registry: Registry,
        settings: LoraSettings,
        metrics: ControlMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._registry = registry
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self.router: Router | None = None  # set once built: the router orders, and is told
        self.on_answers: Callable[[], None] = lambda: None  # answers of waiting requests out
        self._http: aiohttp.ClientSession | None = None
        self._loads: dict[tuple[str, str], asyncio.Task[LoadResult]] = {}
        # One backend's loads and unloads run one at a time, in the order they were decided:
        # two loads at once could unload an adapter the other has just loaded (it was the
        # first's victim and the second's adapter), and the engine would then answer 404 to
        # requests control sends it there.
        self._turns: dict[str, asyncio.Lock] = {}

    def start(self, http: aiohttp.ClientSession) -> asyncio.Task[None] | None:
        """The session calls go through; the watch task when engines are read periodically."""
        self._http = http
        if self._settings.refresh > 0:
            return asyncio.create_task(self._watch())
        return None

    # -- loads ----------------------------------------------------------------------------

    def order(self, order: LoadOrder) -> None:
        """The router began a load (single flight is its): run it."""
        key = (order.backend, order.adapter.name)
        self._loads[key] = asyncio.get_running_loop().create_task(self._load(order))

    async def load(self, backend_id: str, adapter: Adapter) -> LoadResult:
        """An operator's load: the one in flight, or a new one (evicting as placement would)."""
        key = (backend_id, adapter.name)
        running = self._loads.get(key)
        if running is None:
            book = self._registry.adapters
            if not book.residency.begin_load(backend_id, adapter.name):
                await asyncio.sleep(0)  # begun by the router this very turn
                running = self._loads.get(key)
            else:
                evict = book.residency.victims(backend_id, now=self._clock(),
                                               min_idle=self._settings.min_idle)  # fmt: skip
                self.order(LoadOrder(BackendId(backend_id), adapter, evict, PlaceReason.ADMIN,
                                     ""))  # fmt: skip
                running = self._loads[key]
        if running is None:
            return LoadResult(False, 0.0, "a load of it there is in flight")
        return await asyncio.shield(running)

    def _turn(self, backend_id: str) -> asyncio.Lock:
        return self._turns.setdefault(backend_id, asyncio.Lock())

    async def _load(self, order: LoadOrder) -> LoadResult:
        started = time.perf_counter()
        async with self._turn(order.backend):
            result = await self._load_now(order, started)
        self._settle(order, result)
        return result

    async def _load_now(self, order: LoadOrder, started: float) -> LoadResult:
        name, bid = order.adapter.name, order.backend
        evicted: list[str] = []
        try:
            for victim in order.evict:
                ok, _ = await self._unload(bid, victim, why="evict")
                if ok:
                    evicted.append(victim)
            status, detail = await self._post(bid, "/v1/load_lora_adapter",
                                              {"lora_name": name,
                                               "lora_path": order.adapter.source})  # fmt: skip
            ok = status == 200 or (status == 400 and "already been loaded" in detail)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            ok, detail = False, "control stopped"
        return LoadResult(ok, (time.perf_counter() - started) * 1000, "" if ok else detail,
                          tuple(evicted))  # fmt: skip

    def _settle(self, order: LoadOrder, result: LoadResult) -> None:
        name, bid = order.adapter.name, order.backend
        self._loads.pop((bid, name), None)
        self._metrics.adapter_loads.labels(bid, "ok" if result.ok else "failed").inc()
        self._metrics.adapter_load_seconds.observe(result.ms / 1000)
        self._registry.events.record(
            AdapterChange(adapter=name, action="load", ok=result.ok, ms=round(result.ms, 2),
                          reason=order.reason.value, evicted=",".join(result.evicted) or None,
                          detail=result.detail or None),
            request_id=order.request_id, backend_id=bid,
        )  # fmt: skip
        if not result.ok:
            log.warning("adapter %s did not load on %s: %s", name, bid, result.detail)
        if self.router is not None:
            self.router.adapter_loaded(bid, name, result.ok, result.detail)
        self.on_answers()

    async def unload(self, backend_id: str, name: str, *, why: str = "admin") -> tuple[bool, str]:
        """Unload `name` from the backend: (whether it is unheld now, the engine's answer)."""
        async with self._turn(backend_id):
            return await self._unload(backend_id, name, why=why)

    async def _unload(self, backend_id: str, name: str, *, why: str) -> tuple[bool, str]:
        try:
            status, detail = await self._post(backend_id, "/v1/unload_lora_adapter",
                                              {"lora_name": name})  # fmt: skip
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return False, f"{type(exc).__name__}: {exc}"
        gone = status in (200, 404)
        if gone:
            self._registry.adapters.unloaded(backend_id, name)
            self._metrics.adapter_unloads.labels(backend_id, why).inc()
            self._registry.events.record(
                AdapterChange(adapter=name, action="unload", ok=True, reason=why,
                              detail=None if status == 200 else "the engine did not hold it"),
                backend_id=backend_id,
            )  # fmt: skip
        return gone, detail

    async def _post(self, backend_id: str, path: str, body: dict[str, str]) -> tuple[int, str]:
        assert self._http is not None, "adapters used before start()"
        backend = self._registry.backend(backend_id)
        async with self._http.post(
            backend.url + path, json=body, headers=backend.call_headers(os.environ),
            timeout=aiohttp.ClientTimeout(total=self._settings.load_timeout),
        ) as resp:  # fmt: skip
            return resp.status, await resp.text()

    # -- what the engines hold --------------------------------------------------------------

    async def _watch(self) -> None:
        """Every `refresh` seconds, and at once when a backend becomes routable (a replica
        that (re)joined may hold other adapters than before, or none after a restart)."""
        joined = asyncio.Event()
        routable: set[str] = set()

        def look(snapshot: Snapshot) -> None:
            now = {s.backend.id for s in snapshot.backends if s.routable}
            if now - routable:
                joined.set()
            routable.clear()
            routable.update(now)

        stop = self._registry.subscribe(look)
        try:
            while True:
                joined.clear()
                with contextlib.suppress(Exception):
                    await self.refresh()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(joined.wait(), self._settings.refresh)
        finally:
            stop()

    async def refresh(self) -> None:
        """Read every routable backend's adapters once; the book learns them (a restart that
        lost them, an adapter loaded by someone else), and each change is an audit event."""
        assert self._http is not None
        http = self._http
        up = [s.backend for s in self._registry.snapshot.backends if s.routable]
        read_at = self._clock()
        found = await asyncio.gather(*(fetch_adapters(http, b, 2.0) for b in up))
        book = self._registry.adapters
        for backend, seen in zip(up, found, strict=True):
            if seen is None or self._registry.find(backend.id) is None:
                continue
            drift = book.read(backend.id, backend.model, seen, self._settings.max_adapters,
                              read_at)  # fmt: skip
            if drift is None:
                continue  # not an adapter engine
            for name in drift.added:
                self._registry.events.record(AdapterChange(adapter=name, action="found"),
                                             backend_id=backend.id)  # fmt: skip
            for name in drift.dropped:
                self._registry.events.record(AdapterChange(adapter=name, action="lost"),
                                             backend_id=backend.id)  # fmt: skip
