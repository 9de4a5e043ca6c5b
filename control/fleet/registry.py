"""The single owner of fleet state: backends, their health and drains, the facts read from
them, in-flight load, prefix pins and the KV index (the blocks each engine holds). Every
mutation goes through here and publishes a new, immutable, versioned Snapshot to subscribers;
readers never see half-applied state (the KV index changes too often to be in snapshots: it
is read through `cached_blocks`).

Speculative pairs are control/pairs/flow.py's: it asks the registry through the few narrow
methods below (`find`, `routable`, `facts`, `set_facts`, `on_remove`) and owns its PairTable."""

# baton: pure

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

from baton.model import Adapter, Backend, BackendId, BackendStatus, RequestShape, Snapshot
from baton.pricing import PriceTable
from baton.tenancy import Tenant
from control.audit.log import EventLog
from control.audit.payloads import Admin, HealthChange, KvChange
from control.exceptions import BackendExists, BackendNotFound
from control.fleet import health
from control.fleet.adapter_book import AdapterBook
from control.fleet.health import HealthRecord
from control.fleet.inflight import Load
from control.fleet.owners import OwnerTable
from control.fleet.pins import PinTable
from control.fleet.placement import Placement
from control.fleet.sources import CLI, CONFIG, OPERATED, by
from control.fleet.tenants import TenantBook
from control.settings import HealthPolicy
from control.signals.engine_load import EngineLoad, LoadView, Readings
from control.signals.facts import Facts
from control.signals.kv.feed import KvFeed
from control.signals.kv.index import KvIndex, KvStatus

log = logging.getLogger("baton.control.fleet")

Clock = Callable[[], float]
Listener = Callable[[Snapshot], None]
RemoveHook = Callable[[BackendId], None]


class Registry:
    def __init__(
        self,
        backends: Iterable[Backend] = (),
        *,
        clock: Clock,
        health_policy: HealthPolicy | None = None,
        events: EventLog | None = None,
        pins: PinTable | None = None,
        owners: OwnerTable | None = None,
        sessions: PinTable | None = None,
        drained: Mapping[str, bool] | None = None,
        kv_capacity: int = 1_000_000,
        tenants: Iterable[Tenant] = (),
        adapters: Iterable[Adapter] = (),
        prices: PriceTable | None = None,
        sources: Mapping[str, str] | None = None,  # id -> CLI: added at run time
    ) -> None:
        """`drained`: backends drained before a restart (id -> migrate), restored as they
        were, with no new audit event: nobody drained them just now."""
        self._clock = clock
        self._events = events if events is not None else EventLog(clock)
        self._policy = health_policy or HealthPolicy()
        self._backends: dict[BackendId, Backend] = {}
        self._health: dict[BackendId, HealthRecord] = {}
        self._sources: dict[BackendId, str] = {}  # control/fleet/sources.py
        self._listeners: list[Listener] = []
        self._removed: list[RemoveHook] = []
        self._load = Load()
        # While a leader replica has followers: in-flight changes as ops (control/fleet/journal.py).
        self._journal: Callable[[tuple[object, ...]], None] | None = None
        # Where conversations' state is: prefix pins, sessions, stored responses, and which
        # KV blocks a prefix implies (control/fleet/placement.py).
        self.placement = Placement(pins, sessions, owners)
        # Each engine's own load (control/signals/engine_load.py), and Baton's routes to it since
        # that reading.
        self._readings = Readings()
        # Facts read from each backend's engine (control/signals/published.py); absent until read.
        self._facts: dict[BackendId, Facts] = {}
        self._facts_view: Mapping[BackendId, Facts] = MappingProxyType(self._facts)
        self._model_len: dict[BackendId, int] = {}  # from each engine's /v1/models
        self._kv = KvIndex(kv_capacity, on_change=self._kv_changed)  # blocks per backend
        # What control/fleet/kv_subscribers.py's subscribers tell the index, on this registry's
        # clock.
        self.kv = KvFeed(self._kv, clock, lambda bid: bid in self._backends, self._publish)
        now = clock()
        for b in backends:
            if b.id in self._backends:
                raise BackendExists(f"backend {b.id!r} is listed twice")
            self._backends[b.id] = b
            self._health[b.id] = HealthRecord.new(now)
            self._sources[b.id] = (sources or {}).get(b.id, CONFIG)
        self._migrating: set[BackendId] = set()  # drained with --migrate (DRAINING either way)
        for bid, migrate in (drained or {}).items():
            if bid in self._backends:
                known = BackendId(bid)
                self._health[known] = health.drain(self._health[known], now)
                if migrate:
                    self._migrating.add(known)
        self._snapshot = Snapshot(0, ())
        self._shims = 0  # watching the snapshots now
        # LoRA adapters: declared and found, which backend holds which, their demand
        # (control/fleet/adapter_book.py); what shims need of it is in every snapshot.
        self.adapters = AdapterBook(adapters, on_change=self._publish)
        # Who may use the fleet and what each uses now (control/fleet/tenants.py): a change
        # of tenants is published in the snapshot, so every shim knows the keys within one.
        self.tenants = TenantBook(tenants, on_change=self._publish, prices=prices)
        self._publish()

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def events(self) -> EventLog:
        """The audit log: its own owner, shared by everything that records."""
        return self._events

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def on_remove(self, hook: RemoveHook) -> None:
        """Called with a backend's id as it is removed, before the new snapshot is published
        and the admin event recorded, so what hangs off it (a pair) goes first."""
        self._removed.append(hook)

    def backend(self, backend_id: str) -> Backend:
        return self._backends[self._known(backend_id)]

    def find(self, backend_id: str) -> Backend | None:
        """The backend, or None when it is gone (removed while a request was in flight)."""
        return self._backends.get(BackendId(backend_id))

    def routable(self, backend_id: str) -> bool:
        s = self._snapshot.get(backend_id)
        return s is not None and s.routable

    @property
    def backends(self) -> tuple[Backend, ...]:
        return tuple(self._backends[bid] for bid in sorted(self._backends))

    def drained(self) -> dict[BackendId, bool]:
        """Backends an operator drained (id -> migrate): configuration, kept across restarts."""
        return {bid: bid in self._migrating for bid in sorted(self._health)
                if self._health[bid].drained and self._sources[bid] in OPERATED}  # fmt: skip

    def discovered(self, backend_id: str) -> bool:
        return self._sources.get(BackendId(backend_id), CONFIG) not in OPERATED

    # -- configuration --------------------------------------------------------------------

    def add(self, backend: Backend, source: str = CLI) -> BackendStatus:
        if backend.id in self._backends:
            raise BackendExists(f"backend {backend.id!r} already exists")
        twin = next((b for b in self._backends.values() if b.clashes_with(backend)), None)
        if twin is not None:
            raise BackendExists(
                f"backend {twin.id!r} already serves {backend.url} as that engine: give each "
                "its own data_parallel_rank"
            )
        self._backends[backend.id] = backend
        self._health[backend.id] = HealthRecord.new(self._clock())
        self._sources[backend.id] = source
        self._publish()
        self._events.record(Admin(action="add", url=backend.url, model=backend.model,
                                  kind_of_backend=backend.kind.value, role=backend.role.value,
                                  source=by(source)), backend_id=backend.id)  # fmt: skip
        return self._status(backend.id)

    def remove(self, backend_id: str) -> None:
        bid = self._known(backend_id)
        source = self._sources.pop(bid)
        del self._backends[bid]
        del self._health[bid]
        self._migrating.discard(bid)
        self._facts.pop(bid, None)
        self._kv.forget(bid)
        self.adapters.forget(bid)
        for hook in list(self._removed):
            hook(bid)
        # Its pins stay until used (then re-pinned, visibly, as `repin`) or expired.
        self._publish()
        self._events.record(Admin(action="remove", source=by(source)), backend_id=bid)

    def drain(self, backend_id: str, migrate: bool = False, *, source: str = CLI,
              reason: str = "drained by admin") -> BackendStatus:  # fmt: skip
        """No new requests to the backend; with `migrate`, shims also move its in-flight
        streams elsewhere (the resume protocol). Draining again changes only `migrate`."""
        bid = self._known(backend_id)
        status = self._drain_step(bid, migrate, lambda rec, now: health.drain(rec, now, reason))
        self._events.record(Admin(action="drain", migrate=migrate, source=by(source)),
                            backend_id=bid)  # fmt: skip
        return status

    def undrain(self, backend_id: str, *, source: str = CLI) -> BackendStatus:
        bid, policy = self._known(backend_id), self._policy
        status = self._drain_step(bid, False, lambda rec, now: health.undrain(rec, now, policy))
        self._events.record(Admin(action="undrain", source=by(source)), backend_id=bid)
        return status

    def _drain_step(
        self, bid: BackendId, migrate: bool, step: Callable[[HealthRecord, float], HealthRecord]
    ) -> BackendStatus:
        flipped = (bid in self._migrating) != migrate
        if migrate:
            self._migrating.add(bid)
        else:
            self._migrating.discard(bid)
        version = self._snapshot.version
        status = self._update(bid, step)
        # Shims learn of a migration from the snapshot, even when the state stays DRAINING.
        if flipped and self._snapshot.version == version:
            self._publish()
        return status

    # -- health ---------------------------------------------------------------------------

    def report_failure(self, backend_id: str, reason: str) -> BackendStatus | None:
        """A shim saw a real failure. Unknown ids are ignored: the backend may just have
        been removed while the request was in flight."""
        if backend_id not in self._backends:
            return None
        return self._update(backend_id, lambda rec, now: health.passive_failure(rec, reason, now))

    def probe_result(
        self, backend_id: str, ok: bool, reason: str = "", *, slow: bool = False
    ) -> BackendStatus | None:
        """`slow`: the probe timed out rather than failed (HealthPolicy.slow_after)."""
        if backend_id not in self._backends:
            return None
        if ok:
            return self._update(
                backend_id, lambda rec, now: health.probe_ok(rec, now, self._policy)
            )
        return self._update(
            backend_id,
            lambda rec, now: health.probe_failed(rec, reason, now, self._policy, slow=slow),
        )

    # -- facts ----------------------------------------------------------------------------

    @property
    def facts(self) -> Mapping[BackendId, Facts]:
        """Facts last read from each backend (read-only; `set_facts` changes them)."""
        return self._facts_view

    def set_max_model_len(self, backend_id: str, length: int) -> None:
        """What the engine says its context length is (a restart may change it)."""
        bid = BackendId(backend_id)
        if bid in self._backends and self._model_len.get(bid) != length:
            self._model_len[bid] = length
            self._publish()

    def set_facts(self, backend_id: str, facts: Facts, *, known_only: bool = True) -> None:
        """`known_only=False` keeps facts even for an id not (or no longer) registered: the
        gate stores what it just read from a target, which may have been removed meanwhile."""
        if not known_only or backend_id in self._backends:
            self._facts[BackendId(backend_id)] = facts

    def forget_facts(self, backend_id: str) -> None:
        """The backend came back and could not tell its facts: what it said before its
        restart no longer stands (a pair fails closed until they are read again)."""
        self._facts.pop(BackendId(backend_id), None)

    # -- load: which backend each in-flight request holds ---------------------------------

    def in_flight(self) -> Mapping[BackendId, int]:
        return self._load.counts()

    def in_flight_total(self) -> int:
        return self._load.total()

    def acquire(self, request_id: str, backend_id: BackendId, now: float) -> None:
        if self._journal is not None:
            self._journal(("acquire", request_id, backend_id, now))
        self._load.acquire(request_id, backend_id, now)

    # -- the engines' own load (control/signals/engine_load.py) ---------------------------

    def set_engine_load(self, backend_id: str, load: EngineLoad | None) -> None:
        """A reading of the engine's gauges (None: it could not be read)."""
        if backend_id in self._backends:
            bid = BackendId(backend_id)
            self._readings.read(bid, load, self._load.counts().get(bid, 0))

    def load_views(self, now: float, stale_after: float) -> dict[BackendId, LoadView]:
        return self._readings.views(self._backends, self._load.counts(), now, stale_after)

    def cached_tokens(self, shape: RequestShape) -> tuple[dict[BackendId, int], int | None]:
        """Prompt tokens of `shape` each backend holds in its KV cache by its own events (only
        backends whose event stream is live), and the prompt's length when known exactly."""
        found = self.placement.implied(shape.prefix_chain)
        if found is None:
            return {}, None
        i, implied = found
        held = self._kv.cached(implied.keys, implied.block_size)
        exact = implied.tokens if i == len(shape.prefix_chain) - 1 and implied.tokens else None
        return {b: n * implied.block_size for b, n in held.items()}, exact

    def engine_load(self, backend_id: str) -> EngineLoad | None:
        """The last reading, fresh or not (for `baton backends list` and /metrics)."""
        return self._readings.last(BackendId(backend_id))

    def release(self, request_id: str) -> BackendId | None:
        if self._journal is not None:
            self._journal(("release", request_id))
        return self._load.release(request_id)

    def held(self) -> Iterator[tuple[str, BackendId, float]]:
        """Each in-flight request: (id, backend, since)."""
        return self._load.held()

    def clear_load(self) -> None:
        """A follower replica takes a new leader's in-flight requests whole."""
        self._load = Load()

    def journal_to(self, journal: Callable[[tuple[object, ...]], None] | None) -> None:
        """Every change to soft state (in-flight requests, pins, owners, tenants' use) as an
        op to `journal` (None: stop): a leader replica's followers replay them."""
        self._journal = journal
        self.placement.journal = journal
        self.tenants.journal = journal

    def shims_watching(self, change: int) -> None:
        """A shim began (1) or stopped (-1) watching snapshots: each shim's share of the
        tenants' limits, while control is away, is one of this many."""
        self._shims += change
        self._publish()

    def expire_load(self, now: float) -> int:
        self.tenants.expire(now)
        return self._load.expire(now)

    # -- KV index: the prefix blocks each engine really holds (control/signals/kv/index.py) --

    def kv_status(self) -> Mapping[BackendId, KvStatus]:  # a backend absent here is `off`
        return self._kv.statuses()

    def cached_blocks(self, keys: Sequence[int], block_size: int) -> Mapping[BackendId, int]:
        """How many of a prefix's leading blocks (baton.blocks keys of `block_size`-token
        blocks) each backend's engine holds. Only backends whose index is live answer: a
        backend absent here is unknown, never 0 (a dead index is never trusted)."""
        return self._kv.cached(keys, block_size)

    def _kv_changed(self, bid: BackendId, before: KvStatus, after: KvStatus) -> None:
        self._events.record(
            KvChange(state=after.state.value, previous=before.state.value, reason=after.reason,
                     blocks_before=before.blocks),
            backend_id=bid,
        )  # fmt: skip

    # -- internals ------------------------------------------------------------------------

    def _known(self, backend_id: str) -> BackendId:
        bid = BackendId(backend_id)
        if bid not in self._backends:
            raise BackendNotFound(f"no backend with id {backend_id!r}")
        return bid

    def _status(self, bid: BackendId) -> BackendStatus:
        kv = self._kv.status(bid)
        return BackendStatus(self._backends[bid], self._health[bid].health, bid in self._migrating,
                             self._model_len.get(bid, 0), kv.block_size if kv else 0,
                             self.adapters.held(bid), self.adapters.capacity(bid),
                             self._sources[bid])  # fmt: skip

    def _update(
        self, backend_id: str, step: Callable[[HealthRecord, float], HealthRecord]
    ) -> BackendStatus:
        bid = self._known(backend_id)
        before = self._health[bid]
        after = step(before, self._clock())
        self._health[bid] = after
        # Streak counters change on every probe; only a visible change is a new snapshot.
        if after.health != before.health:
            self._publish()
            if after.health.state is not before.health.state:
                log.info("backend %s: %s -> %s (%s)", bid, before.health.state.value,
                         after.health.state.value, after.health.reason)  # fmt: skip
                self._events.record(
                    HealthChange(state=after.health.state, previous=before.health.state,
                                 reason=after.health.reason),
                    backend_id=bid,
                )  # fmt: skip
        return self._status(bid)

    def _publish(self) -> None:
        statuses = tuple(self._status(bid) for bid in sorted(self._backends))
        self._snapshot = Snapshot(
            self._snapshot.version + 1, statuses, self.tenants.all(), self._shims,
            self.adapters.all(), self.tenants.prices,
        )
        for listener in list(self._listeners):
            listener(self._snapshot)
