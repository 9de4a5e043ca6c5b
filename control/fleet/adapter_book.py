"""The fleet's LoRA adapters (issue 42), owned in one place: the ones the operator declared
([[adapters]] and `baton adapters load`), the ones found on the engines' /v1/models, which
backend holds which (control/fleet/adapters.py's Residency), how much each is asked for
(Demand), and the loads that failed lately. The registry holds one and publishes what the
shims need of it in every snapshot: the adapters clients may name, and per backend the ones it
holds and how many it may hold. A change of those is a new snapshot; a request's use of an
adapter (its recency) is not."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from baton.model import Adapter
from control.fleet.adapters import Demand, Drift, Residency

if TYPE_CHECKING:  # the reading is plumbing's (it fetches over HTTP); only its shape here
    from control.signals.adapters import EngineAdapters


class AdapterBook:
    def __init__(
        self,
        declared: Iterable[Adapter] = (),
        *,
        on_change: Callable[[], None] = lambda: None,
        half_life: float = 30.0,
    ) -> None:
        self._declared: dict[str, Adapter] = {a.name: a for a in declared}
        self._found: dict[str, Adapter] = {}  # listed by an engine, not declared
        self._all: tuple[Adapter, ...] = ()
        self.residency = Residency()
        self.demand = Demand(half_life)
        self._failed: dict[tuple[str, str], tuple[float, str]] = {}  # -> (until, why)
        self._on_change = on_change
        self._index()

    # -- what clients may name --------------------------------------------------------------

    def all(self) -> tuple[Adapter, ...]:
        """Every adapter clients may name, by name (a declared one wins over a found one)."""
        return self._all

    def get(self, name: str) -> Adapter | None:
        return self._declared.get(name) or self._found.get(name)

    def declared(self) -> tuple[Adapter, ...]:
        return tuple(self._declared[n] for n in sorted(self._declared))

    def declare(self, adapter: Adapter) -> None:
        self._declared[adapter.name] = adapter
        self._index()
        self._on_change()

    def _index(self) -> None:
        merged = {**self._found, **self._declared}
        self._all = tuple(merged[n] for n in sorted(merged))

    # -- what each backend holds -------------------------------------------------------------

    def held(self, backend: str) -> tuple[str, ...]:
        return tuple(sorted(self.residency.held(backend)))

    def capacity(self, backend: str) -> int:
        return self.residency.capacity(backend) or 0

    def learned(
        self, backend: str, base: str, listed: Mapping[str, str], max_lora: int | None,
        read_at: float,
    ) -> Drift:  # fmt: skip
        """An engine serving `base` listed `listed` (adapter name -> its source) in /v1/models
        and said it holds `max_lora` at most (None: it did not say)."""
        before = (self.held(backend), self.capacity(backend), self._all)
        drift = self.residency.learned(backend, listed, read_at)
        if max_lora is not None:
            self.residency.set_capacity(backend, max_lora)
        for name, source in listed.items():
            if name not in self._declared:
                self._found[name] = Adapter(name, base, source)
        self._index()
        if (self.held(backend), self.capacity(backend), self._all) != before:
            self._on_change()
        return drift

    def read(
        self, backend: str, base: str, seen: EngineAdapters, configured: int, read_at: float
    ) -> Drift | None:
        """What an engine said of its adapters (control/signals/adapters.py), learned; None
        when it is no adapter engine (no LoRA gauge, lists none, holds none). How many it
        holds: the operator's number (`configured`, [lora] max_adapters), else the engine's
        max_lora; until its page says, what it was taken to hold, or vLLM's default
        --max-loras (1)."""
        if not (seen.lora or seen.listed or self.held(backend)):
            return None
        room = configured or seen.max_lora or self.capacity(backend) or 1
        return self.learned(backend, base, seen.listed, room, read_at)

    def loaded(self, backend: str, name: str, ok: bool, now: float, why: str = "",
               retry_after: float = 0.0) -> None:  # fmt: skip
        """A load Baton began ended; a failed one is not tried there again for `retry_after`
        seconds."""
        before = self.held(backend)
        self.residency.end_load(backend, name, ok, now)
        if ok:
            self._failed.pop((backend, name), None)
        else:
            self._failed[(backend, name)] = (now + retry_after, why)
        if self.held(backend) != before:
            self._on_change()

    def leave(self, backend: str, name: str) -> None:
        """`name` is to be unloaded from `backend` (a load's victim): off routing now."""
        before = self.held(backend)
        self.residency.leave(backend, name)
        if self.held(backend) != before:
            self._on_change()

    def unloaded(self, backend: str, name: str) -> None:
        before = self.held(backend)
        self.residency.unloaded(backend, name)
        if self.held(backend) != before:
            self._on_change()

    def failed_lately(self, backend: str, name: str, now: float) -> str | None:
        """Why the last load of `name` on `backend` failed, while it is not to be retried."""
        entry = self._failed.get((backend, name))
        if entry is None:
            return None
        if now >= entry[0]:
            del self._failed[(backend, name)]
            return None
        return entry[1]

    def forget(self, backend: str) -> None:
        """The backend left the fleet."""
        self.residency.forget(backend)
        for key in [k for k in self._failed if k[0] == backend]:
            del self._failed[key]
