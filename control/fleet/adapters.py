"""LoRA adapters on the fleet (issue 42): which adapters the operator declared, which each
backend holds, and how much each is asked for (an adapter itself is baton.model.Adapter).
One owner (control/fleet/adapter_book.py holds one `Residency` and one `Demand`); the
placement decision that reads them is `control.routing.adapters.place`.

What the engine does (vLLM 0.32, docs/research `vllm-lora-cpu.md`): a replica serves an
adapter named as the request's `model`; `--max-loras` bounds the distinct adapters in one
running batch (one more waits inside the engine, seconds) and `--max-cpu-loras` how many it
keeps loaded (LRU: an evicted one is reloaded from disk, 100s of ms to seconds on a GPU).
`POST /v1/load_lora_adapter` registers and preloads one, `/v1/unload_lora_adapter` drops it;
a restart loses every runtime-loaded adapter.

`Residency`, per backend:
- `held(b)`: the adapters it holds, least recently used first; `holds(b, name)`,
  `holders(name)` (sorted backend ids);
- `capacity(b)`: how many it should hold at once (`set_capacity`; None = unbounded, e.g. not
  yet learned from the engine's `max_lora` label or config);
- `touch(b, name, now)`: a request was served with it (it is resident, and now the newest);
- `begin_load(b, name) -> bool` / `end_load(b, name, ok, now)`: single flight per
  (backend, adapter): `begin_load` is False while that load is already in flight, and the
  caller then waits for the running one instead of issuing another;
- `victims(b, room_for, now=, min_idle=)`: the least recently used adapters to unload so that
  `room_for` more fit in the capacity (an in-flight load takes a slot), never one being loaded,
  one with requests routed to it and not ended (`begin_use`/`end_use`), nor one used within
  `min_idle` seconds; `fits` says whether that makes enough room;
- `learned(b, names, read_at)`: what the engine lists in /v1/models is the truth: adapters
  Baton thought it held but the engine no longer lists (a restart; one not used or loaded
  since `read_at`) are dropped, unknown listed ones are added
  as the least recently used; returns the `Drift`;
- `forget(b)`: the backend left the fleet; `loads_in_flight()`.

`Demand`: a per-adapter request rate (an exponentially decayed count, time passed in), which
placement turns into how many replicas an adapter should span."""

# baton: pure

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Drift:
    """How an engine's own list differed from what Baton believed (for the audit log)."""

    added: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()


@dataclass(slots=True)
class _Backend:
    held: OrderedDict[str, float | None] = field(default_factory=OrderedDict)  # name -> last use
    loading: set[str] = field(default_factory=set)
    capacity: int | None = None
    # Requests routed to it with each adapter and not ended: an adapter in use is never
    # unloaded (vLLM answers 404 to a request whose adapter went before it arrived).
    in_use: dict[str, int] = field(default_factory=dict)
    # Chosen to be unloaded, the engine not yet told: not held for routing, and not taken
    # back from the engine's own list meanwhile (it still lists them until the unload).
    leaving: set[str] = field(default_factory=set)


class Residency:
    """Which adapters each backend holds (LRU order), its capacity and its loads in flight."""

    def __init__(self) -> None:
        self._backends: dict[str, _Backend] = {}

    def _get(self, backend: str) -> _Backend:
        return self._backends.setdefault(backend, _Backend())

    def backends(self) -> tuple[str, ...]:
        return tuple(sorted(self._backends))

    def set_capacity(self, backend: str, n: int | None) -> None:
        if n is not None and n < 0:
            raise ValueError(f"capacity must be >= 0, got {n}")
        self._get(backend).capacity = n

    def capacity(self, backend: str) -> int | None:
        entry = self._backends.get(backend)
        return entry.capacity if entry is not None else None

    def held(self, backend: str) -> tuple[str, ...]:
        """The adapters `backend` holds, least recently used first."""
        entry = self._backends.get(backend)
        return tuple(entry.held) if entry is not None else ()

    def holds(self, backend: str, name: str) -> bool:
        entry = self._backends.get(backend)
        return entry is not None and name in entry.held

    def loading(self, backend: str, name: str) -> bool:
        entry = self._backends.get(backend)
        return entry is not None and name in entry.loading

    def holders(self, name: str) -> tuple[str, ...]:
        return tuple(b for b in sorted(self._backends) if name in self._backends[b].held)

    def loads_in_flight(self) -> tuple[tuple[str, str], ...]:
        """(backend, adapter) of every load begun and not ended, sorted."""
        return tuple(sorted((b, n) for b, e in self._backends.items() for n in e.loading))

    def touch(self, backend: str, name: str, now: float) -> None:
        """A request on `backend` was served with `name`: it is resident and the newest."""
        entry = self._get(backend)
        entry.held[name] = now
        entry.held.move_to_end(name)

    def begin_use(self, backend: str, name: str) -> None:
        """A request was routed to `backend` with `name`: not to be unloaded until it ends."""
        entry = self._get(backend)
        entry.in_use[name] = entry.in_use.get(name, 0) + 1

    def end_use(self, backend: str, name: str) -> None:
        entry = self._backends.get(backend)
        if entry is None or name not in entry.in_use:
            return
        entry.in_use[name] -= 1
        if entry.in_use[name] <= 0:
            del entry.in_use[name]

    def in_use(self, backend: str, name: str) -> int:
        entry = self._backends.get(backend)
        return entry.in_use.get(name, 0) if entry is not None else 0

    def begin_load(self, backend: str, name: str) -> bool:
        """Start loading `name` on `backend`; False when that load is already in flight."""
        entry = self._get(backend)
        if name in entry.loading:
            return False
        entry.loading.add(name)
        return True

    def end_load(self, backend: str, name: str, ok: bool, now: float) -> None:
        """The load ended; on success the adapter is held, as the most recently used."""
        entry = self._backends.get(backend)
        if entry is None or name not in entry.loading:
            return  # forgotten (the backend left) or relearned meanwhile: nothing to settle
        entry.loading.discard(name)
        if ok:
            self.touch(backend, name, now)

    def leave(self, backend: str, name: str) -> None:
        """`name` is to be unloaded from `backend`: it is not held from now on."""
        entry = self._get(backend)
        entry.held.pop(name, None)
        entry.leaving.add(name)

    def unloaded(self, backend: str, name: str) -> None:
        """Baton unloaded `name` from `backend` (or the engine refused it: 404)."""
        entry = self._backends.get(backend)
        if entry is not None:
            entry.held.pop(name, None)
            entry.leaving.discard(name)

    def victims(
        self, backend: str, room_for: int = 1, *, now: float, min_idle: float = 0.0
    ) -> tuple[str, ...]:
        """Least recently used adapters to unload so `room_for` more fit within the capacity;
        never one with a load in flight or used within `min_idle` seconds of `now`. Fewer than
        needed (see `fits`) when too many are busy; () when there is room or no capacity.
        One with requests in flight is never chosen."""
        entry = self._backends.get(backend)
        if entry is None or entry.capacity is None:
            return ()
        taken = len(entry.held.keys() | entry.loading)
        excess = taken + room_for - entry.capacity
        out: list[str] = []
        for name, last in entry.held.items():
            if len(out) >= excess:
                break
            if name in entry.loading or name in entry.in_use or (
                    last is not None and now - last < min_idle):  # fmt: skip
                continue
            out.append(name)
        return tuple(out)

    def fits(self, backend: str, room_for: int = 1, *, now: float, min_idle: float = 0.0) -> bool:
        """Whether unloading `victims(...)` leaves room for `room_for` more adapters."""
        entry = self._backends.get(backend)
        if entry is None or entry.capacity is None:
            return True
        taken = len(entry.held.keys() | entry.loading)
        free = entry.capacity - taken + len(self.victims(backend, room_for, now=now,
                                                         min_idle=min_idle))  # fmt: skip
        return free >= room_for

    def learned(self, backend: str, names: Iterable[str], read_at: float | None = None) -> Drift:
        """The engine lists exactly `names`: drop what it no longer lists (a restart, an
        unload elsewhere), add what Baton did not know as the least recently used. `read_at`:
        when the list was asked for; an adapter used or loaded since is kept (the list may
        predate its load)."""
        entry = self._get(backend)
        listed = dict.fromkeys(names)
        dropped = tuple(n for n, last in entry.held.items() if n not in listed
                        and (read_at is None or last is None or last < read_at))  # fmt: skip
        for name in dropped:
            del entry.held[name]
        added = tuple(n for n in listed if n not in entry.held and n not in entry.leaving)
        fresh: OrderedDict[str, float | None] = OrderedDict((n, None) for n in added)
        fresh.update(entry.held)
        entry.held = fresh
        entry.loading -= set(added)  # an in-flight load the engine already lists is done
        return Drift(added, dropped)

    def forget(self, backend: str) -> None:
        """The backend left the fleet: nothing is held there, its loads settle to nothing."""
        self._backends.pop(backend, None)


class Demand:
    """Per-adapter request rate: an exponentially decayed count with half-life `half_life`
    seconds. For a steady rate r the count tends to r * tau (tau = half_life / ln 2), so
    `rate` = count / tau is in requests per second; a burst fades by half every half-life."""

    def __init__(self, half_life: float = 30.0) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self._tau = half_life / math.log(2)
        self._counts: dict[str, tuple[float, float]] = {}  # name -> (count, as of)

    def _decayed(self, name: str, now: float) -> float:
        count, at = self._counts.get(name, (0.0, now))
        return count * math.exp(-max(0.0, now - at) / self._tau)

    def observe(self, name: str, now: float, weight: float = 1.0) -> None:
        self._counts[name] = (self._decayed(name, now) + weight, now)

    def rate(self, name: str, now: float) -> float:
        return self._decayed(name, now) / self._tau

    def rates(self, now: float) -> dict[str, float]:
        return {name: self.rate(name, now) for name in sorted(self._counts)}

    def prune(self, now: float, below: float = 1e-3) -> tuple[str, ...]:
        """Forget adapters whose rate fell under `below` (bounds memory); returns them."""
        gone = tuple(n for n in sorted(self._counts) if self.rate(n, now) < below)
        for name in gone:
            del self._counts[name]
        return gone
