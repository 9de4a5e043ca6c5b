"""Discovery's plumbing between the sources and the registry: each source's watch task keeps
its view (the endpoints it sees now); one applier turns the views into plans
(control/discovery/plan.py) and applies them through the registry's ordinary paths (add,
drain, undrain, remove), as `baton backends` does.

With control replicas every replica watches, so a new leader's view is current at once; only
the leader asks engines their models and changes the fleet, and on becoming leader it
applies what it sees (`poke`). A follower's registry holds no discovered backend, so a new
leader adds, in their phase now, the endpoints it has seen ready (its predecessor had them):
one that turned terminating while no replica led is still drained with migrate. A source that
has not listed yet changes nothing: its backends are never removed for want of a first
answer."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Mapping
from functools import partial
from random import Random
from typing import Any

import aiohttp

from control.discovery import dns, kube
from control.discovery.endpoints import (
    API_KEY_ENV,
    MODEL,
    Endpoint,
    Phase,
    backend_for,
    from_pods,
    from_records,
    from_slices,
)
from control.discovery.plan import Add, Drain, Refuse, Remove, Undrain, Wanted, plan
from control.discovery.settings import DiscoverySettings, DnsSource, KubeSource, Source
from control.discovery.settings import source_name as name_of
from control.exceptions import BackendExists, BackendNotFound, ConfigError
from control.fleet.registry import Registry

log = logging.getLogger("baton.control.discovery")
RETRY_S = 1.0  # while an engine has not told its model, it is asked again this often


class Discovery:
    def __init__(
        self,
        registry: Registry,
        settings: DiscoverySettings,
        *,
        leading: Callable[[], bool],
        http: Callable[[], aiohttp.ClientSession],
        rng: Random,
    ) -> None:
        self._registry = registry
        self._settings = settings
        self._leading = leading
        self._http = http
        self._rng = rng
        self._views: dict[str, dict[str, Endpoint]] = {}  # source -> endpoint id -> endpoint
        self._was_ready: dict[str, set[str]] = {}  # source -> ids ready since it listed them
        self._models: dict[str, str] = {}  # url -> the model its engine serves
        self._changed = asyncio.Event()
        self._said: set[tuple[str, str]] = set()  # warnings given (each once)
        self.reflectors: dict[str, kube.Reflector] = {}

    def tasks(self) -> list[Coroutine[Any, Any, None]]:
        """The watch of every source and the applier, for the caller to run and cancel."""
        out: list[Coroutine[Any, Any, None]] = [self.apply_forever()]
        for s in self._settings.sources:
            if isinstance(s, KubeSource):
                r = kube.Reflector(s, partial(self._saw_objects, s), self._rng)
                self.reflectors[s.name] = r
                out.append(r.run())
            else:
                out.append(dns.watch(s, partial(self._saw_records, s)))
        return out

    def poke(self) -> None:
        """Apply the views now (this replica just became the leader)."""
        self._changed.set()

    def view(self, source: str) -> Mapping[str, Endpoint]:
        return self._views.get(source, {})

    def _saw_objects(self, s: KubeSource, objs: list[Mapping[str, Any]]) -> None:
        self.saw(s, from_slices(objs, s) if s.service else from_pods(objs, s))

    def _saw_records(self, s: DnsSource, found: list[tuple[str, int]]) -> None:
        self.saw(s, from_records(s.name, found))

    def saw(self, s: Source, endpoints: dict[str, Endpoint]) -> None:
        """What source `s` sees now (its watch calls this after every change)."""
        name = name_of(s)
        self._views[name] = endpoints
        ready = {e.id for e in endpoints.values() if e.phase is Phase.READY}
        self._was_ready[name] = (self._was_ready.get(name, set()) & set(endpoints)) | ready
        self._changed.set()

    async def apply_forever(self) -> None:
        while True:
            self._changed.clear()
            pending = False
            if self._leading():
                for s in self._settings.sources:
                    pending |= await self._apply(s)
            try:
                await asyncio.wait_for(self._changed.wait(), RETRY_S if pending else None)
            except TimeoutError:
                pass

    async def _apply(self, s: Source) -> bool:
        """One source's plan, applied; True while some ready endpoint's model is unknown."""
        name = name_of(s)
        view = self._views.get(name)
        if view is None:
            return False
        was_ready = self._was_ready.get(name, set())
        await self._learn_models(s, view, was_ready)
        wanted: dict[str, Wanted] = {}
        pending = False
        for e in view.values():
            model = e.said(MODEL) or s.engine.model or self._models.get(e.url, "")
            pending |= not model and (e.phase is Phase.READY or e.id in was_ready)
            try:
                backend = backend_for(e, model, s.engine) if model else None
            except ConfigError as exc:
                self._warn(e.id, f"{name}: endpoint {e.id} left out: {exc}")
                continue
            wanted[e.id] = Wanted(e.phase, backend, e.id in was_ready)
        if not self._leading():  # it may have stopped leading while engines were asked
            return pending
        reg = self._registry
        actions = plan(name, wanted, reg.snapshot.backends, reg.in_flight(),
                       linger=isinstance(s, DnsSource))  # fmt: skip
        for action in actions:
            self._do(name, action)
        return pending

    def _do(self, source: str, action: Add | Remove | Drain | Undrain | Refuse) -> None:
        reg = self._registry
        try:
            match action:
                case Add(backend):
                    reg.add(backend, source)
                    log.info("%s: backend %s joins (%s)", source, backend.id, backend.url)
                case Remove(bid):
                    reg.remove(bid)
                    log.info("%s: backend %s removed", source, bid)
                case Drain(bid, migrate, reason):
                    reg.drain(bid, migrate, source=source, reason=reason)
                    log.info("%s: backend %s drained%s: %s", source, bid,
                             " with migrate" if migrate else "", reason)  # fmt: skip
                case Undrain(bid):
                    reg.undrain(bid, source=source)
                case Refuse(bid, holder):
                    self._warn(bid, f"{source}: endpoint {bid} left out: backend {bid!r} "
                                    f"({holder}) has its id")  # fmt: skip
        except (BackendExists, BackendNotFound) as exc:
            self._warn(str(action), f"{source}: {exc}")

    async def _learn_models(
        self, s: Source, view: Mapping[str, Endpoint], was_ready: set[str]
    ) -> None:
        """Asks each engine ready (now, or since listed) that nothing names a model of its
        model (/v1/models)."""
        ask = {e.url: e for e in view.values() if (e.phase is Phase.READY or e.id in was_ready)
               and not (e.said(MODEL) or s.engine.model) and e.url not in self._models}  # fmt: skip
        if ask:
            found = await asyncio.gather(*(self._model_of(e) for e in ask.values()))
            self._models.update((url, m) for url, m in zip(ask, found, strict=True) if m)
        # Forget the engines no source lists any more (an address may come back as another).
        listed = {e.url for v in self._views.values() for e in v.values()}
        for url in set(self._models) - listed:
            del self._models[url]

    async def _model_of(self, e: Endpoint) -> str:
        env = e.said(API_KEY_ENV)
        key = os.environ.get(env, "") if env else ""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        timeout = aiohttp.ClientTimeout(total=self._settings.model_timeout)
        try:
            async with self._http().get(f"{e.url}/v1/models", headers=headers,
                                        timeout=timeout) as resp:  # fmt: skip
                body = await resp.json() if resp.status == 200 else {}
            data = body.get("data") if isinstance(body, dict) else None
            first = data[0] if isinstance(data, list) and data else {}
            model = first.get("id") if isinstance(first, dict) else None
            return model if isinstance(model, str) else ""
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("%s: /v1/models: %s", e.url, exc)
            return ""

    def _warn(self, key: str, message: str) -> None:
        if (key, message) not in self._said:
            self._said.add((key, message))
            log.warning("%s", message)
