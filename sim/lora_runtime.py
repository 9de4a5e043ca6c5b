"""The LoRA side of one sim server (plumbing around sim.lora): loading adapters from their
directories, the registry requests resolve against, each rank's loaded adapters and the
LoRA metrics.

As vLLM 0.32's OpenAIServingModels and engine do it:

* A load (``load``: POST /v1/load_lora_adapter, and each --lora-modules entry at start)
  holds a lock per name; checks the request; takes an int id; has every engine rank load
  the adapter (``add_lora``: its files read and checked, --lora-load-ms paid once, the
  least recently used adapter evicted where a rank's cache is full); and only then
  registers it. A load in place reloads it under the same id.
* An unload removes the name from the registry only: vLLM's unload never calls the
  engine's remove_lora, so the weights stay loaded until evicted.
* A request naming an adapter (``resolve``) runs under it; with runtime updating on,
  vLLM's resolve_lora takes an id from the counter for every name it cannot resolve.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING

from sim.lora import (
    CONFIG_FILE,
    NOT_ENABLED,
    WEIGHT_FILES,
    Adapter,
    LoraRequestStates,
    Registry,
    check_config,
    load_failed,
    not_found,
    weights_identity,
)
from sim.protocol import ApiError, Limits

if TYPE_CHECKING:
    from sim.config import SimConfig
    from sim.engine import EngineRank
    from sim.metrics import LoraMetrics


class Loras:
    """Created inside the running loop (its locks are asyncio's)."""

    def __init__(
        self, cfg: SimConfig, engines: list[EngineRank], metrics: LoraMetrics | None
    ) -> None:
        self.cfg = cfg
        self.registry = Registry(cfg.limits.model)
        self._engines = engines
        self._metrics = metrics
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._states = LoraRequestStates()

    @property
    def enabled(self) -> bool:
        return self.cfg.lora is not None

    # -- requests ------------------------------------------------------------------
    def resolve(self, model: object) -> Adapter | None:
        """The adapter a request's ``model`` names, or None (the base model, or a name
        the request's parser refuses with vLLM's 404)."""
        if not isinstance(model, str) or not model or model == self.registry.base:
            return None
        adapter = self.registry.get(model)
        if adapter is None and self.cfg.runtime_lora_updating:
            self.registry.next_id()  # resolve_lora's id, taken though nothing resolves it
        return adapter

    def limits(self, adapter: Adapter | None) -> Limits:
        """What a request is checked against: under an adapter, its name is the model's."""
        limits = self.cfg.limits
        return limits if adapter is None else replace(limits, model=adapter.name)

    def started(self, adapter: Adapter | None, request: int) -> None:
        """A request's first output (vLLM's API server sees it from there)."""
        if adapter is not None:
            self._states.running(adapter.name, request)
        self._refresh()

    def finished(self, adapter: Adapter | None, request: int) -> None:
        if adapter is not None:
            self._states.finished(adapter.name, request)
        self._refresh()

    def loaded(self, adapter: Adapter, rank: int) -> None:
        if self._metrics is not None:
            self._metrics.loads.labels(adapter.name, str(rank)).inc()

    def _refresh(self) -> None:
        if self._metrics is not None:
            self._metrics.current(*self._states.labels())

    # -- loads and unloads ---------------------------------------------------------
    async def load(self, name: str, path: str, inplace: bool = False) -> str:
        """Load (or reload in place) and register an adapter; raises ApiError as vLLM
        answers. Returns vLLM's success text."""
        async with self._locks[name]:
            self.registry.check_load(name, path, inplace)
            int_id = self.registry.id_for(name)
            lora = self.cfg.lora
            if lora is None:
                raise load_failed(NOT_ENABLED)
            identity = await asyncio.to_thread(_read_adapter, name, path, lora.max_lora_rank)
            adapter = Adapter(name, int_id, path, identity, self.registry.base, inplace)
            await self._preload(adapter, lora.load_s)
            self.registry.add(adapter)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        async with self._locks[name]:
            self.registry.check_unload(name)
            self.registry.remove(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def load_static(self) -> None:
        """--lora-modules, in order, before the server is ready; the first that fails
        stops the start, as vLLM's init_static_loras does."""
        lora = self.cfg.lora
        for module in lora.modules if lora is not None else ():
            try:
                await self.load(module.name, module.path)
            except ApiError as e:
                raise SystemExit(f"--lora-modules {module.name}: {e.message}") from None

    async def _preload(self, adapter: Adapter, load_s: float) -> None:
        """vLLM's add_lora on every engine core: each loads it into its cache (the ranks in
        parallel, so the cost is paid once)."""
        paid = False
        for engine in self._engines:
            if engine.adapters is not None and engine.adapters.add(
                adapter, force=adapter.load_inplace
            ):
                self.loaded(adapter, engine.rank)
                paid = True
        if paid and load_s > 0:
            await asyncio.sleep(load_s)


def _read_adapter(name: str, path: str, max_lora_rank: int) -> int:
    """The adapter's identity from its files, read as vLLM's _load_adapter reads them (in a
    worker thread); ApiError as vLLM answers a failed load."""
    where = os.path.expanduser(path)
    try:
        with open(os.path.join(where, CONFIG_FILE), "rb") as f:
            config = f.read()
        check_config(config, max_lora_rank)
        for weights_file in WEIGHT_FILES:
            weights_path = os.path.join(where, weights_file)
            if os.path.isfile(weights_path):
                with open(weights_path, "rb") as f:
                    return weights_identity(config, f.read())
    except FileNotFoundError:
        raise not_found(name, path) from None
    except (OSError, ValueError) as e:
        raise load_failed(str(e)) from None
    raise load_failed(f"{os.path.abspath(where)} doesn't contain tensors")
