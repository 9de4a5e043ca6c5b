"""What the shim needs from control, in small Protocols that each consumer composes into the
few calls it makes (handlers: Routing; the relay: FailoverAdvice + FailoverAudit; the proxy
and the speculative server add Outcomes and Gate), and the types they speak in. The gRPC
implementation of all of them is dataplane/link/control_link.py (ControlLink)."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from baton.model import (
    Backend,
    Decision,
    FailoverReport,
    Failure,
    RequestOutcome,
    RequestShape,
    Snapshot,
    Verdict,
)
from baton.tenancy import Tenant


@dataclass(frozen=True, slots=True)
class GateAnswer:
    verdict: Verdict
    reason: str
    target: Backend | None  # on reject: where the draft was re-bound (None: go target-only)


@dataclass(frozen=True, slots=True)
class FleetView:
    """The part of control's snapshot the shim serves locally: /v1/models, and every route
    while control is unreachable."""

    version: int = 0
    models: tuple[str, ...] = ()
    # Each model's context length: the least its backends report (absent: none said).
    model_lens: Mapping[str, int] = field(default_factory=dict)
    backends: tuple[Backend, ...] = field(default_factory=tuple)
    snapshot: Snapshot = field(default_factory=lambda: Snapshot(0, ()))
    # Ids drained with --migrate, whose streams move elsewhere (dataplane/relay/stream.py checks it
    # at every chunk, hence a set). Derived here so it can never disagree with `snapshot`.
    migrating: frozenset[str] = field(init=False, default=frozenset())
    # Control's tenants' keys, by digest: the tenant each key belongs to (dataplane/edge/
    # limits.py). Derived here too, once per snapshot.
    tenant_keys: Mapping[bytes, str] = field(init=False, default_factory=dict)
    tenants: Mapping[str, Tenant] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        ids = frozenset(b.backend.id for b in self.snapshot.backends if b.migrating)
        object.__setattr__(self, "migrating", ids)
        keys = {k.digest: t.id for t in self.snapshot.tenants for k in t.keys}
        object.__setattr__(self, "tenant_keys", keys)
        object.__setattr__(self, "tenants", {t.id: t for t in self.snapshot.tenants})


class Fleet(Protocol):
    @property
    def fleet(self) -> FleetView: ...


class Routing(Fleet, Protocol):
    async def route(
        self, request_id: str, shape: RequestShape, traceparent: str = ""
    ) -> Decision: ...

    def finished(self, outcome: RequestOutcome) -> None: ...


class FailoverAdvice(Fleet, Protocol):
    async def failover(
        self,
        request_id: str,
        shape: RequestShape,
        failed_backend_id: str,
        failure: Failure,
        exclude: Sequence[str],
        preferred: Sequence[str] = (),
        traceparent: str = "",
        pair_id: str = "",
    ) -> Decision: ...


class FailoverAudit(Protocol):
    def report_failover(self, report: FailoverReport) -> None: ...


class Outcomes(Protocol):
    async def attempt_failed(
        self, request_id: str, backend_id: str, failure: Failure, detail: str
    ) -> None: ...

    def finished(self, outcome: RequestOutcome) -> None: ...


class Gate(Protocol):
    async def gate_pairing(
        self, request_id: str, pair_id: str, target_id: str, drafted: int, accepted: int
    ) -> GateAnswer: ...


class Ownership(Protocol):
    async def record_owner(
        self, request_id: str, key: str, backend_id: str, model: str, *, released: bool = False
    ) -> None: ...


def models_of(backends: Sequence[Backend]) -> tuple[str, ...]:
    return tuple(sorted({b.model for b in backends if b.serves_clients}))


def fleet_view(snapshot: Snapshot) -> FleetView:
    backends = tuple(b.backend for b in snapshot.backends)
    lens: dict[str, int] = {}
    for s in snapshot.backends:
        if s.max_model_len and s.backend.serves_clients:
            model = s.backend.model
            lens[model] = min(lens.get(model, s.max_model_len), s.max_model_len)
    return FleetView(snapshot.version, models_of(backends), lens, backends, snapshot)
