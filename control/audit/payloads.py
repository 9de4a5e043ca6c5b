"""The kinds of audit event, and one typed payload per kind (a routing decision has its own
row shape: log.ROUTE_FIELDS). The payload's fields are the event's data, so the durable log's
rows have one schema per kind, which tests/unit/test_audit_schema.py checks against what
control writes; a field that is None is left out of the row (an optional field not said). A
field typed with an enum is written as the enum's value."""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar, Literal

from baton.model import FailoverOutcome, Failure, HealthState, PairState, ResumePath, Seam


class EventKind(StrEnum):
    ROUTE = "route"
    RETRY = "retry"
    FAILOVER = "failover"
    HEALTH = "health"
    ADMIN = "admin"
    PAIR = "pair"
    KV = "kv"  # a backend's KV-cache index changed state (control/signals/kv/index.py)
    ADAPTER = "adapter"  # a LoRA adapter loaded, unloaded or found changed on a backend
    BUDGET = "budget"  # a tenant's spend reached one of its budgets (baton/budgets.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Before the first byte: the shim moved the request to its next fallback."""

    KIND: ClassVar[EventKind] = EventKind.RETRY
    failure: Failure
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Failover:
    """How one choice's failover ended, as the shim reported it."""

    KIND: ClassVar[EventKind] = EventKind.FAILOVER
    trace_id: str
    from_backend: str
    to_backend: str
    failure: Failure
    choice: int
    tokens_sent: int
    path: ResumePath | Literal["none"]
    seam: Seam | Literal["none"]
    gap_ms: float
    attempt: int
    outcome: FailoverOutcome | Literal["unknown"]
    detail: str = ""
    tenant: str | None = None  # the request's tenant id (never its key); none: an open shim


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthChange:
    KIND: ClassVar[EventKind] = EventKind.HEALTH
    state: HealthState
    previous: HealthState
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class KvChange:
    """A backend's KV index changed state (control/signals/kv/index.py)."""

    KIND: ClassVar[EventKind] = EventKind.KV
    state: str
    previous: str
    reason: str
    blocks_before: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Admin:
    """An operator's change to the fleet. `action`: add, remove, drain, undrain, clear-pins
    (backends); add-tenant, update-tenant, remove-tenant, add-tenant-key, revoke-tenant-key;
    set-price, unset-price (a model's price); the other fields are said by the actions they
    belong to. A tenant's key is never said: only its key id (the first hex digits of its
    digest)."""

    KIND: ClassVar[EventKind] = EventKind.ADMIN
    action: str
    url: str | None = None  # add
    model: str | None = None  # add, set-price, unset-price
    kind_of_backend: str | None = None  # add
    role: str | None = None  # add
    migrate: bool | None = None  # drain
    cleared: int | None = None  # clear-pins
    tenant: str | None = None  # the *-tenant and *-tenant-key actions
    key_id: str | None = None  # add-tenant, add-tenant-key, revoke-tenant-key
    priority: str | None = None  # add-tenant, update-tenant
    weight: int | None = None  # add-tenant, update-tenant
    # add-tenant, update-tenant: the limits set, e.g. "concurrent=4 requests_per_minute=60
    # models=a,b"; "" for none
    limits: str | None = None
    # set-price: per million tokens, e.g. "input=3 cached_input=0.3 output=15"
    price: str | None = None
    # add, remove, drain, undrain made by discovery (control/discovery/), not an operator: the
    # source that saw the change ("k8s:NAMESPACE/SERVICE", "dns:NAME")
    source: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PairChange:
    """A speculative pair changed (control/pairs/flow.py). `action`: bind, unbind, reject,
    repair, accept, probation, active, detach, rebind, refused."""

    KIND: ClassVar[EventKind] = EventKind.PAIR
    pair: str
    action: str
    draft: str | None = None
    target: str | None = None
    state: PairState | None = None
    params_hash: str | None = None
    reason: str | None = None
    previous: str | None = None  # repair: the target that failed
    observed: float | None = None  # a gate's verdict: the acceptance seen
    baseline: float | None = None  # and the pair's paired baseline


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterChange:
    """A LoRA adapter on one backend (control/server/adapter_loader.py, control/fleet/
    adapter_book.py). `action`: load (Baton loaded it: `ok`, `ms`, `reason` the placement's,
    `evicted` what it unloaded first), unload (an operator's or Baton's), found and lost (the
    engine's /v1/models listed it, or stopped listing it: a restart, an unload elsewhere).
    The event's request id is the request whose route asked for the load."""

    KIND: ClassVar[EventKind] = EventKind.ADAPTER
    adapter: str
    action: str
    ok: bool | None = None
    ms: float | None = None
    reason: str | None = None
    evicted: str | None = None  # comma-separated names
    detail: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetReached:
    """A tenant's settled spend reached one of its budgets, once a period: a soft budget
    only says so; a hard one refuses the tenant's requests until `reset`. Amounts are
    decimal strings of currency; times ISO 8601 on the budget's own zone. The event's request
    id is the request whose cost reached it."""

    KIND: ClassVar[EventKind] = EventKind.BUDGET
    tenant: str
    period: str
    zone: str
    soft: bool
    amount: str
    spent: str
    reset: str


Payload = (Retry | Failover | HealthChange | KvChange | Admin | PairChange | AdapterChange
           | BudgetReached)  # fmt: skip
PAYLOADS: tuple[type[Payload], ...] = (Retry, Failover, HealthChange, KvChange, Admin, PairChange,
                                       AdapterChange, BudgetReached)  # fmt: skip


def data_of(payload: Payload) -> dict[str, Any]:
    """The event's data: the payload's fields, those not said (None) left out."""
    out = {}
    for f in fields(payload):
        value = getattr(payload, f.name)
        if value is not None:
            out[f.name] = value
    return out
