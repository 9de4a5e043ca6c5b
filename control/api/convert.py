"""Control's own messages (admin answers, audit events, pins, pairs, gate verdicts, tenants'
configuration and usage) to and from the generated *_pb2 types; what both sides exchange is
converted in baton/wire.py."""

from __future__ import annotations

from typing import Any

import orjson

from baton import wire_money
from baton.budgets import Budget
from baton.model import BackendId, BackendKind, Role, RouteRequest
from baton.tenancy import Limits, Priority, Tenant
from baton.v1 import admin_pb2, fleet_pb2, routing_pb2
from baton.wire import (
    FAILOVER_OUTCOME_FROM_PB,
    KIND_FROM_PB,
    PAIR_STATE_TO_PB,
    PATH_FROM_PB,
    PRIORITY_FROM_PB,
    ROLE_FROM_PB,
    SEAM_FROM_PB,
    VERDICT_TO_PB,
    backend_to_pb,
    failure_from_pb,
    limits_from_pb,
    shape_from_pb,
    timestamp,
)
from control.audit.log import Event, EventQuery
from control.audit.payloads import Admin, Failover
from control.exceptions import ConfigError
from control.fleet.owners import Owned
from control.fleet.pins import Pin
from control.fleet.registry import Registry
from control.fleet.tenants import Usage
from control.pairs.flow import GateResult
from control.pairs.table import Pair
from control.signals.kv.index import KvState, KvStatus


def backend_fields_from_pb(b: fleet_pb2.Backend) -> dict[str, Any]:
    """Raw fields for config.make_backend, which validates them; unset enums get defaults."""
    kind = KIND_FROM_PB.get(b.kind, BackendKind.VLLM)
    role = ROLE_FROM_PB.get(b.role, Role.SERVE)
    return {"id": b.id, "url": b.url, "model": b.model, "kind": kind.value, "role": role.value,
            "api_key_env": b.api_key_env, "reasoning_parser": b.reasoning_parser,
            "tool_parser": b.tool_parser, "kv_events": b.kv_events,
            "kv_events_replay": b.kv_events_replay,
            "data_parallel_rank": (b.data_parallel_rank if b.HasField("data_parallel_rank")
                                   else None)}  # fmt: skip


def route_request_from_pb(
    request_id: str, shape: routing_pb2.RequestShape, exclude: tuple[str, ...] = ()
) -> RouteRequest:
    return RouteRequest(request_id, shape_from_pb(shape), frozenset(BackendId(e) for e in exclude))


def pair_to_pb(p: Pair, baseline: float | None) -> fleet_pb2.Pair:
    return fleet_pb2.Pair(
        id=p.id,
        model=p.model,
        draft_backend_id=p.draft_id,
        target_backend_id=p.target_id,
        bound_target_backend_id=p.bound_target_id,
        num_draft_tokens=p.num_draft_tokens,
        params_hash=p.params_hash,
        state=PAIR_STATE_TO_PB[p.state],
        baseline_acceptance=baseline or 0.0,
        recent_acceptance=p.recent or 0.0,
        rounds=p.rounds,
        reason=p.reason,
    )


def gate_response(g: GateResult) -> routing_pb2.GatePairingResponse:
    return routing_pb2.GatePairingResponse(
        verdict=VERDICT_TO_PB[g.verdict],
        reason=g.reason,
        target=backend_to_pb(g.target) if g.target is not None else None,
        baseline_acceptance=g.baseline or 0.0,
        observed_acceptance=g.observed,
    )


def event_to_pb(e: Event) -> fleet_pb2.Event:
    return fleet_pb2.Event(
        seq=e.seq,
        time=timestamp(e.time),
        kind=e.kind.value,
        request_id=e.request_id,
        backend_id=e.backend_id,
        json=orjson.dumps(e.to_json()).decode(),
    )


def event_query_from_pb(q: admin_pb2.ListEventsRequest) -> EventQuery:
    since = q.since.ToNanoseconds() / 1e9 if q.HasField("since") else 0.0
    return EventQuery(q.kind, q.request_id, q.backend_id, since, q.limit or 1000)


def failover_event(r: routing_pb2.ReportFailoverRequest) -> Failover:
    """The failover event's payload, from the shim's report."""
    return Failover(
        trace_id=r.trace_id,
        from_backend=r.from_backend_id,
        to_backend=r.to_backend_id,
        failure=failure_from_pb(r.failure_class, r.failure),
        choice=r.choice_index,
        tokens_sent=r.tokens_sent,
        path=PATH_FROM_PB.get(r.path, "none"),
        seam=SEAM_FROM_PB.get(r.seam, "none"),
        gap_ms=round(r.gap_ms, 3),
        attempt=r.attempt,
        outcome=FAILOVER_OUTCOME_FROM_PB.get(r.outcome, "unknown"),
        detail=r.detail,
        tenant=r.tenant or None,
    )


def pin_to_pb(p: Pin) -> admin_pb2.PinInfo:
    return admin_pb2.PinInfo(
        prefix=p.prefix,
        backend_id=p.backend_id,
        depth=p.depth,
        created=timestamp(p.created),
        last_used=timestamp(p.last_used),
        hits=p.hits,
        kind="prefix",
        key=p.prefix.hex(),
    )


def session_to_pb(p: Pin) -> admin_pb2.PinInfo:
    return admin_pb2.PinInfo(
        backend_id=p.backend_id,
        created=timestamp(p.created),
        last_used=timestamp(p.last_used),
        hits=p.hits,
        kind="session",
        key=p.prefix.decode(errors="replace"),
    )


def owned_to_pb(o: Owned) -> admin_pb2.PinInfo:
    return admin_pb2.PinInfo(
        backend_id=o.backend_id,
        created=timestamp(o.created),
        last_used=timestamp(o.last_used),
        hits=o.hits,
        kind="response",
        key=o.key,
    )


KV_STATE_TO_PB = {
    KvState.OFF: admin_pb2.KV_INDEX_STATE_OFF,
    KvState.LIVE: admin_pb2.KV_INDEX_STATE_LIVE,
    KvState.REPLAYING: admin_pb2.KV_INDEX_STATE_REPLAYING,
    KvState.LOST: admin_pb2.KV_INDEX_STATE_LOST,
}


def kv_status_to_pb(s: KvStatus) -> admin_pb2.KvIndexStatus:
    return admin_pb2.KvIndexStatus(
        state=KV_STATE_TO_PB[s.state],
        reason=s.reason,
        since=timestamp(s.since),
        blocks=s.blocks,
        block_size=s.block_size,
        next_seq=-1 if s.next_seq is None else s.next_seq,
    )


def configured_tenant_from_pb(t: fleet_pb2.Tenant, *, update: bool = False) -> Tenant:
    """An operator's tenant from AddTenant or UpdateTenant, read strictly (wire.tenant_from_pb
    reads a snapshot's leniently, as a shim must): its keys are ignored (control makes them),
    an unknown class is refused. On add, an unset class is
    standard and an unset weight 1; an update replaces the whole configuration, so it must
    say both (the CLI sends the current values of what it does not change)."""
    if t.priority == fleet_pb2.PRIORITY_CLASS_UNSPECIFIED and update:
        raise ConfigError(f"tenant {t.id!r}: an update says the priority class")
    unset = t.priority == fleet_pb2.PRIORITY_CLASS_UNSPECIFIED
    priority = Priority.STANDARD if unset else PRIORITY_FROM_PB.get(t.priority)
    if priority is None:
        raise ConfigError(f"tenant {t.id!r}: unknown priority class {t.priority}")
    limits = limits_from_pb(t.limits)
    if any(not m.strip() for m in limits.models):
        raise ConfigError(f"tenant {t.id!r}: a model name is empty")
    try:
        budgets = tuple(wire_money.budget_from_pb(b) for b in t.budgets)
    except ValueError as exc:
        raise ConfigError(f"tenant {t.id!r}: budget: {exc}") from None
    if len(set(budgets)) != len(budgets):
        raise ConfigError(f"tenant {t.id!r}: a budget is given twice")
    # An update's weight 0 is left to the tenant book to refuse: weights are at least 1.
    return Tenant(t.id, priority, t.weight if t.weight or update else 1, limits,
                  budgets=budgets)  # fmt: skip


def limits_text(lim: Limits, budgets: tuple[Budget, ...] = ()) -> str:
    """The limits set, as the audit log says them: "concurrent=4 models=a,b
    budgets=50/day@UTC,1000/month@UTC:soft"; "" for none."""
    said = [f"{name}={v}" for name, v in lim.rates() if v is not None]
    if lim.models:
        said.append("models=" + ",".join(sorted(lim.models)))
    if budgets:
        said.append("budgets=" + ",".join(b.text() for b in budgets))
    return " ".join(said)


def tenant_event(action: str, t: Tenant, key_id: str | None = None) -> Admin:
    """The audit event of a change to a tenant: its id and key id, never a key."""
    configured = action in ("add-tenant", "update-tenant")
    return Admin(
        action=action,
        tenant=t.id,
        key_id=key_id,
        priority=t.priority.value if configured else None,
        weight=t.weight if configured else None,
        limits=limits_text(t.limits, t.budgets) if configured else None,
    )


def usage_to_pb(u: Usage) -> admin_pb2.TenantUsage:
    return admin_pb2.TenantUsage(
        tenant_id=u.tenant_id,
        requests=u.requests,
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        refused=u.refused,
        in_flight=u.in_flight,
        queued_seconds=u.queued_s,
        cost=wire_money.decimal(u.cost),
        budgets=[wire_money.standing_to_pb(s) for s in u.budgets],
    )


def unpriced(registry: Registry) -> list[str]:
    """The models the fleet serves (its backends' and its adapters') that have no price: they
    cost 0 against every budget, which `baton tenants usage` says rather than a silent 0."""
    snap = registry.snapshot
    served = (b.backend.model for b in snap.backends if b.backend.role is not Role.DRAFT)
    models = set(served) | {a.name for a in snap.adapters}
    return sorted(m for m in models if not snap.prices.priced(m))
