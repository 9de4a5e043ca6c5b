"""The single owner of fleet state. Every mutation goes through here and publishes a new,
immutable, versioned Snapshot to subscribers; readers never see half-applied state."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from control import health
from control.affinity import PinTable
from control.events import EventKind, EventLog
from control.health import HealthPolicy, HealthRecord
from control.load import Load
from control.model import Backend, BackendId, BackendStatus, Snapshot


class RegistryError(Exception):
    """Base of the registry's refusals; services/errors.py maps each to a gRPC status."""


class BackendExists(RegistryError):
    pass


class BackendNotFound(RegistryError):
    pass


Clock = Callable[[], float]
Listener = Callable[[Snapshot], None]


class Registry:
    def __init__(
        self,
        backends: Iterable[Backend] = (),
        *,
        clock: Clock,
        health_policy: HealthPolicy | None = None,
        events: EventLog | None = None,
        pins: PinTable | None = None,
    ) -> None:
        self._clock = clock
        self.events = events if events is not None else EventLog(clock)
        self._policy = health_policy or HealthPolicy()
        self._backends: dict[BackendId, Backend] = {}
        self._health: dict[BackendId, HealthRecord] = {}
        self._listeners: list[Listener] = []
        self.load = Load()
        self.pins = pins if pins is not None else PinTable()
        now = clock()
        for b in backends:
            if b.id in self._backends:
                raise BackendExists(f"backend {b.id!r} is listed twice")
            self._backends[b.id] = b
            self._health[b.id] = HealthRecord.new(now)
        self._snapshot = Snapshot(0, ())
        self._publish()

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def in_flight(self) -> Mapping[BackendId, int]:
        return self.load.counts()

    # -- configuration -------------------------------------------------------------------

    def add(self, backend: Backend) -> BackendStatus:
        if backend.id in self._backends:
            raise BackendExists(f"backend {backend.id!r} already exists")
        self._backends[backend.id] = backend
        self._health[backend.id] = HealthRecord.new(self._clock())
        self._publish()
        self.events.record(
            EventKind.ADMIN,
            backend_id=backend.id,
            action="add",
            url=backend.url,
            model=backend.model,
            kind_of_backend=backend.kind.value,
            role=backend.role.value,
        )
        return self._status(backend.id)

    def remove(self, backend_id: str) -> None:
        bid = self._known(backend_id)
        del self._backends[bid]
        del self._health[bid]
        # Its pins stay until used (then re-pinned, visibly, as `repin`) or expired.
        self._publish()
        self.events.record(EventKind.ADMIN, backend_id=bid, action="remove")

    def drain(self, backend_id: str) -> BackendStatus:
        status = self._update(backend_id, lambda rec, now: health.drain(rec, now))
        self.events.record(EventKind.ADMIN, backend_id=backend_id, action="drain")
        return status

    def undrain(self, backend_id: str) -> BackendStatus:
        status = self._update(backend_id, lambda rec, now: health.undrain(rec, now))
        self.events.record(EventKind.ADMIN, backend_id=backend_id, action="undrain")
        return status

    # -- health --------------------------------------------------------------------------

    def report_failure(self, backend_id: str, reason: str) -> BackendStatus | None:
        """A shim saw a real failure. Unknown ids are ignored: the backend may just have
        been removed while the request was in flight."""
        if backend_id not in self._backends:
            return None
        return self._update(backend_id, lambda rec, now: health.passive_failure(rec, reason, now))

    def probe_result(self, backend_id: str, ok: bool, reason: str = "") -> BackendStatus | None:
        if backend_id not in self._backends:
            return None
        if ok:
            return self._update(
                backend_id, lambda rec, now: health.probe_ok(rec, now, self._policy)
            )
        return self._update(
            backend_id, lambda rec, now: health.probe_failed(rec, reason, now, self._policy)
        )

    # -- internals -----------------------------------------------------------------------

    def _known(self, backend_id: str) -> BackendId:
        bid = BackendId(backend_id)
        if bid not in self._backends:
            raise BackendNotFound(f"no backend with id {backend_id!r}")
        return bid

    def _status(self, bid: BackendId) -> BackendStatus:
        return BackendStatus(self._backends[bid], self._health[bid].health)

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
                self.events.record(
                    EventKind.HEALTH,
                    backend_id=bid,
                    state=after.health.state.value,
                    previous=before.health.state.value,
                    reason=after.health.reason,
                )
        return self._status(bid)

    def _publish(self) -> None:
        statuses = tuple(self._status(bid) for bid in sorted(self._backends))
        self._snapshot = Snapshot(self._snapshot.version + 1, statuses)
        for listener in list(self._listeners):
            listener(self._snapshot)
