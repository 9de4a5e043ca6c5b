"""The one border between the shared domain types (baton/model.py) and the generated *_pb2
types, for every message both sides of the routing service exchange: control encodes what the
shim decodes here, and the reverse. Control-only messages (admin answers, audit events, pins)
are converted in control/api/convert.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from baton import wire_money
from baton.model import (
    Adapter,
    Backend,
    BackendId,
    BackendKind,
    BackendStatus,
    Decision,
    FailoverOutcome,
    FailoverReport,
    Failure,
    Health,
    HealthState,
    Pairing,
    PairState,
    PrefixBlocks,
    Reason,
    RequestOutcome,
    RequestShape,
    ResumePath,
    Role,
    Seam,
    Snapshot,
    SpecStats,
    Verdict,
)
from baton.tenancy import Limited, Limits, Priority, Quota, Tenant, TenantKey
from baton.v1 import fleet_pb2, routing_pb2

KIND_TO_PB = {
    BackendKind.VLLM: fleet_pb2.BACKEND_KIND_VLLM,
    BackendKind.SGLANG: fleet_pb2.BACKEND_KIND_SGLANG,
    BackendKind.OPENAI: fleet_pb2.BACKEND_KIND_OPENAI,
}
KIND_FROM_PB = {v: k for k, v in KIND_TO_PB.items()}
ROLE_TO_PB = {
    Role.SERVE: fleet_pb2.BACKEND_ROLE_SERVE,
    Role.DRAFT: fleet_pb2.BACKEND_ROLE_DRAFT,
    Role.TARGET: fleet_pb2.BACKEND_ROLE_TARGET,
}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}
STATE_TO_PB = {
    HealthState.HEALTHY: fleet_pb2.HEALTH_STATE_HEALTHY,
    HealthState.DEMOTED: fleet_pb2.HEALTH_STATE_DEMOTED,
    HealthState.DRAINING: fleet_pb2.HEALTH_STATE_DRAINING,
    HealthState.DOWN: fleet_pb2.HEALTH_STATE_DOWN,
}
REASON_TO_PB = {
    Reason.SPREAD: routing_pb2.ROUTE_REASON_SPREAD,
    Reason.PIN_HIT: routing_pb2.ROUTE_REASON_PIN_HIT,
    Reason.SPILL: routing_pb2.ROUTE_REASON_SPILL,
    Reason.REPIN: routing_pb2.ROUTE_REASON_REPIN,
    Reason.DEGRADED: routing_pb2.ROUTE_REASON_DEGRADED,
    Reason.FAILOVER: routing_pb2.ROUTE_REASON_FAILOVER,
    Reason.NO_BACKEND: routing_pb2.ROUTE_REASON_NO_BACKEND,
    Reason.UNKNOWN_MODEL: routing_pb2.ROUTE_REASON_UNKNOWN_MODEL,
    Reason.OWNER: routing_pb2.ROUTE_REASON_OWNER,
    Reason.OWNER_GONE: routing_pb2.ROUTE_REASON_OWNER_GONE,
    Reason.OWNER_UNKNOWN: routing_pb2.ROUTE_REASON_OWNER_UNKNOWN,
    Reason.PREDICTED: routing_pb2.ROUTE_REASON_PREDICTED,
    Reason.TENANT_LIMITED: routing_pb2.ROUTE_REASON_TENANT_LIMITED,
    Reason.TENANT_MODEL: routing_pb2.ROUTE_REASON_TENANT_MODEL,
    Reason.TENANT_UNKNOWN: routing_pb2.ROUTE_REASON_TENANT_UNKNOWN,
    Reason.TENANT_BUDGET: routing_pb2.ROUTE_REASON_TENANT_BUDGET,
    Reason.QUEUED: routing_pb2.ROUTE_REASON_QUEUED,
    Reason.SHED: routing_pb2.ROUTE_REASON_SHED,
}
STATE_FROM_PB = {v: k for k, v in STATE_TO_PB.items()}
REASON_FROM_PB = {v: k for k, v in REASON_TO_PB.items()}
PAIR_STATE_TO_PB = {
    PairState.ACTIVE: fleet_pb2.PAIR_STATE_ACTIVE,
    PairState.PROBATION: fleet_pb2.PAIR_STATE_PROBATION,
    PairState.DETACHED: fleet_pb2.PAIR_STATE_DETACHED,
}
VERDICT_TO_PB = {
    Verdict.ACCEPT: routing_pb2.PAIR_VERDICT_ACCEPT,
    Verdict.PROBATION: routing_pb2.PAIR_VERDICT_PROBATION,
    Verdict.REJECT: routing_pb2.PAIR_VERDICT_REJECT,
}
PAIR_STATE_FROM_PB = {v: k for k, v in PAIR_STATE_TO_PB.items()}
VERDICT_FROM_PB = {v: k for k, v in VERDICT_TO_PB.items()}
# How a failover ended, as the shim reports it (values of the audit event's fields).
PATH_FROM_PB = {
    routing_pb2.RESUME_PATH_TOKEN: ResumePath.TOKEN,
    routing_pb2.RESUME_PATH_TEXT: ResumePath.TEXT,
}
SEAM_FROM_PB = {
    routing_pb2.SEAM_VERDICT_VERIFIED: Seam.VERIFIED,
    routing_pb2.SEAM_VERDICT_DIVERGENT: Seam.DIVERGENT,
    routing_pb2.SEAM_VERDICT_UNCHECKED: Seam.UNCHECKED,
    routing_pb2.SEAM_VERDICT_SAMPLED: Seam.SAMPLED,
}
FAILOVER_OUTCOME_FROM_PB = {
    routing_pb2.FAILOVER_OUTCOME_RESUMED: FailoverOutcome.RESUMED,
    routing_pb2.FAILOVER_OUTCOME_REFUSED: FailoverOutcome.REFUSED,
    routing_pb2.FAILOVER_OUTCOME_EXHAUSTED: FailoverOutcome.EXHAUSTED,
    routing_pb2.FAILOVER_OUTCOME_FAILED: FailoverOutcome.FAILED,
}
# Every Failure but UNKNOWN (a class this side does not know) has its FailureClass.
FAILURE_TO_PB = {
    Failure.CONNECT: routing_pb2.FAILURE_CLASS_CONNECT,
    Failure.DISCONNECT: routing_pb2.FAILURE_CLASS_DISCONNECT,
    Failure.TIMEOUT: routing_pb2.FAILURE_CLASS_TIMEOUT,
    Failure.STATUS_5XX: routing_pb2.FAILURE_CLASS_STATUS_5XX,
    Failure.OVERLOADED: routing_pb2.FAILURE_CLASS_STATUS_429,
    Failure.TRUNCATED: routing_pb2.FAILURE_CLASS_TRUNCATED,
    Failure.ERROR_EVENT: routing_pb2.FAILURE_CLASS_ERROR_EVENT,
    Failure.STALL: routing_pb2.FAILURE_CLASS_STALL,
    Failure.GARBAGE: routing_pb2.FAILURE_CLASS_GARBAGE,
    Failure.REJECTED: routing_pb2.FAILURE_CLASS_STATUS_4XX,
    Failure.FINISH_ABORT: routing_pb2.FAILURE_CLASS_FINISH_ABORT,
    Failure.FINISH_ERROR: routing_pb2.FAILURE_CLASS_FINISH_ERROR,
    Failure.REFUSED: routing_pb2.FAILURE_CLASS_REFUSED,
    Failure.MIGRATE: routing_pb2.FAILURE_CLASS_MIGRATE,
}
FAILURE_FROM_PB = {v: k for k, v in FAILURE_TO_PB.items()}
PATH_TO_PB = {v: k for k, v in PATH_FROM_PB.items()}
PRIORITY_TO_PB = {
    Priority.INTERACTIVE: fleet_pb2.PRIORITY_CLASS_INTERACTIVE,
    Priority.STANDARD: fleet_pb2.PRIORITY_CLASS_STANDARD,
    Priority.BATCH: fleet_pb2.PRIORITY_CLASS_BATCH,
}
PRIORITY_FROM_PB = {v: k for k, v in PRIORITY_TO_PB.items()}
SEAM_TO_PB = {v: k for k, v in SEAM_FROM_PB.items()}
FAILOVER_OUTCOME_TO_PB = {v: k for k, v in FAILOVER_OUTCOME_FROM_PB.items()}


def timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def backend_to_pb(b: Backend) -> fleet_pb2.Backend:
    return fleet_pb2.Backend(
        id=b.id,
        url=b.url,
        model=b.model,
        kind=KIND_TO_PB[b.kind],
        role=ROLE_TO_PB[b.role],
        api_key_env=b.api_key_env,
        reasoning_parser=b.reasoning_parser,
        tool_parser=b.tool_parser,
        kv_events=b.kv_events,
        kv_events_replay=b.kv_events_replay,
        data_parallel_rank=b.data_parallel_rank,
    )


def backend_from_pb(b: fleet_pb2.Backend) -> Backend:
    """For trusted messages from control (the shim's side); admin input goes through
    backend_fields_from_pb and config.make_backend, which validate."""
    return Backend(
        BackendId(b.id),
        b.url,
        b.model,
        KIND_FROM_PB.get(b.kind, BackendKind.VLLM),
        ROLE_FROM_PB.get(b.role, Role.SERVE),
        b.api_key_env,
        b.reasoning_parser,
        b.tool_parser,
        b.kv_events,
        b.kv_events_replay,
        b.data_parallel_rank if b.HasField("data_parallel_rank") else None,
    )


def status_to_pb(s: BackendStatus, in_flight: Mapping[BackendId, int]) -> fleet_pb2.BackendStatus:
    return fleet_pb2.BackendStatus(
        backend=backend_to_pb(s.backend),
        state=STATE_TO_PB[s.health.state],
        reason=s.health.reason,
        since=timestamp(s.health.since),
        in_flight=in_flight.get(s.backend.id, 0),
        migrating=s.migrating,
        max_model_len=s.max_model_len,
        kv_block_size=s.kv_block_size,
        adapters=s.adapters,
        max_adapters=s.max_adapters,
        source=s.source,
    )


def adapter_to_pb(a: Adapter) -> fleet_pb2.Adapter:
    return fleet_pb2.Adapter(name=a.name, base=a.base, source=a.source)


def adapter_from_pb(a: fleet_pb2.Adapter) -> Adapter:
    return Adapter(a.name, a.base, a.source)


def snapshot_to_pb(s: Snapshot, in_flight: Mapping[BackendId, int]) -> fleet_pb2.Snapshot:
    return fleet_pb2.Snapshot(
        version=s.version,
        backends=[status_to_pb(b, in_flight) for b in s.backends],
        tenants=[tenant_to_pb(t) for t in s.tenants],
        shims=s.shims,
        adapters=[adapter_to_pb(a) for a in s.adapters],
        prices=wire_money.prices_to_pb(s.prices),
    )


def limits_to_pb(lim: Limits) -> fleet_pb2.TenantLimits:
    return fleet_pb2.TenantLimits(
        concurrent=lim.concurrent,
        requests_per_minute=lim.requests_per_minute,
        tokens_per_minute=lim.tokens_per_minute,
        models=sorted(lim.models),
    )


def limits_from_pb(lim: fleet_pb2.TenantLimits) -> Limits:
    return Limits(
        concurrent=lim.concurrent if lim.HasField("concurrent") else None,
        requests_per_minute=(
            lim.requests_per_minute if lim.HasField("requests_per_minute") else None
        ),
        tokens_per_minute=lim.tokens_per_minute if lim.HasField("tokens_per_minute") else None,
        models=frozenset(lim.models),
    )


def tenant_to_pb(t: Tenant) -> fleet_pb2.Tenant:
    return fleet_pb2.Tenant(
        id=t.id,
        priority=PRIORITY_TO_PB[t.priority],
        weight=t.weight,
        limits=limits_to_pb(t.limits),
        keys=[
            fleet_pb2.TenantKey(digest=k.digest, key_id=k.key_id, created=timestamp(k.created))
            for k in t.keys
        ],
        budgets=[wire_money.budget_to_pb(b) for b in t.budgets],
    )


def tenant_from_pb(t: fleet_pb2.Tenant) -> Tenant:
    """An unknown class is taken as batch: a newer control's class never outranks here."""
    return Tenant(
        id=t.id,
        priority=PRIORITY_FROM_PB.get(t.priority, Priority.BATCH),
        weight=max(t.weight, 1),
        limits=limits_from_pb(t.limits),
        keys=tuple(TenantKey(k.digest, k.created.ToNanoseconds() / 1e9) for k in t.keys),
        budgets=wire_money.budgets_from_pb(t.budgets, t.id),
    )


def quota_to_pb(q: Quota) -> routing_pb2.Quota:
    return routing_pb2.Quota(
        limit_requests=q.limit_requests,
        remaining_requests=q.remaining_requests,
        reset_requests_ms=round(q.reset_requests_s * 1000),
        limit_tokens=q.limit_tokens,
        remaining_tokens=q.remaining_tokens,
        reset_tokens_ms=round(q.reset_tokens_s * 1000),
        retry_after_ms=round(q.retry_after_s * 1000),
        limited_by=q.limited_by.value if q.limited_by is not None else "",
        reset_at_ms=round(q.reset_at * 1000),
    )


def quota_from_pb(q: routing_pb2.Quota) -> Quota:
    return Quota(
        limit_requests=q.limit_requests,
        remaining_requests=q.remaining_requests,
        reset_requests_s=q.reset_requests_ms / 1000,
        limit_tokens=q.limit_tokens,
        remaining_tokens=q.remaining_tokens,
        reset_tokens_s=q.reset_tokens_ms / 1000,
        retry_after_s=q.retry_after_ms / 1000,
        limited_by=_limited(q.limited_by),
        reset_at=q.reset_at_ms / 1000,
    )


def _limited(name: str) -> Limited | None:
    """None for an empty name (not refused); a limit this shim does not know by name still
    refused, as `requests`."""
    if not name:
        return None
    try:
        return Limited(name)
    except ValueError:
        return Limited.REQUESTS


def shape_from_pb(s: routing_pb2.RequestShape) -> RequestShape:
    return RequestShape(
        model=s.model,
        message_count=s.message_count,
        prefix_chain=tuple(s.prefix_chain),
        assistant_turns=tuple(s.assistant_turns),
        prompt_chars=s.prompt_chars,
        greedy=s.greedy,
        stream=s.stream,
        spec_eligible=s.spec_eligible,
        sets_temperature=s.sets_temperature,
        owner_key=s.owner_key,
        session=s.session,
        tenant=s.tenant,
        max_tokens=s.max_tokens,
    )


def _decision_fields(d: Decision) -> dict[str, Any]:
    return {
        "backends": [backend_to_pb(b) for b in d.backends],
        "reason": REASON_TO_PB[d.reason],
        "snapshot_version": d.snapshot_version,
        "detail": d.detail,
        "pairing": pairing_to_pb(d.pairing) if d.pairing is not None else None,
        "quota": quota_to_pb(d.quota) if d.quota is not None else None,
        "wait_ms": round(d.wait_s * 1000),
    }


def route_response(d: Decision) -> routing_pb2.RouteResponse:
    return routing_pb2.RouteResponse(**_decision_fields(d))


def failover_response(d: Decision) -> routing_pb2.FailoverResponse:
    """The same fields as a route's answer (the two messages are the same shape)."""
    return routing_pb2.FailoverResponse(**_decision_fields(d))


def pairing_to_pb(p: Pairing) -> routing_pb2.SpecPairing:
    return routing_pb2.SpecPairing(
        pair_id=p.pair_id,
        draft=backend_to_pb(p.draft),
        num_draft_tokens=p.num_draft_tokens,
        params_hash=p.params_hash,
        gate_required=p.gate_required,
    )


def shape_to_pb(s: RequestShape) -> routing_pb2.RequestShape:
    return routing_pb2.RequestShape(
        model=s.model,
        message_count=s.message_count,
        prefix_chain=s.prefix_chain,
        assistant_turns=s.assistant_turns,
        prompt_chars=s.prompt_chars,
        greedy=s.greedy,
        stream=s.stream,
        spec_eligible=s.spec_eligible,
        sets_temperature=s.sets_temperature,
        owner_key=s.owner_key,
        session=s.session,
        tenant=s.tenant,
        max_tokens=s.max_tokens,
    )


class Backends:
    """Backends read from control's answers, kept by id: a shim reads the same few backends in
    every decision, and comparing a message to the one it came from costs a fraction of
    building the Backend again (a route's decision names several). Bounded by the fleet."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[fleet_pb2.Backend, Backend]] = {}

    def read(self, b: fleet_pb2.Backend) -> Backend:
        hit = self._seen.get(b.id)
        if hit is not None and hit[0] == b:
            return hit[1]
        if len(self._seen) >= 4096:  # a fleet that churned through ids: start over
            self._seen.clear()
        kept = fleet_pb2.Backend()
        kept.CopyFrom(b)
        backend = backend_from_pb(b)
        self._seen[b.id] = (kept, backend)
        return backend


def decision_from_pb(
    resp: routing_pb2.RouteResponse | routing_pb2.FailoverResponse,
    backends: Backends | None = None,
) -> Decision:
    read = backend_from_pb if backends is None else backends.read
    return Decision(
        tuple(read(b) for b in resp.backends),
        REASON_FROM_PB.get(resp.reason, Reason.NO_BACKEND),
        resp.snapshot_version,
        resp.detail,
        pairing_from_pb(resp.pairing) if resp.HasField("pairing") else None,
        quota=quota_from_pb(resp.quota) if resp.HasField("quota") else None,
        wait_s=resp.wait_ms / 1000,
    )


def pairing_from_pb(p: routing_pb2.SpecPairing) -> Pairing:
    return Pairing(
        p.pair_id,
        backend_from_pb(p.draft),
        p.num_draft_tokens,
        p.params_hash,
        p.gate_required,
    )


def snapshot_from_pb(s: fleet_pb2.Snapshot) -> Snapshot:
    """What degraded routing needs: every backend with its health. An unknown state is
    taken as DOWN, so a newer control's new state never makes a backend routable here."""
    return Snapshot(
        s.version,
        tuple(
            BackendStatus(
                backend_from_pb(b.backend),
                Health(
                    STATE_FROM_PB.get(b.state, HealthState.DOWN),
                    b.reason,
                    b.since.ToNanoseconds() / 1e9,
                ),
                b.migrating,
                b.max_model_len,
                b.kv_block_size,
                tuple(b.adapters),
                b.max_adapters,
                b.source,
            )
            for b in s.backends
        ),
        tuple(tenant_from_pb(t) for t in s.tenants),
        s.shims,
        tuple(adapter_from_pb(a) for a in s.adapters),
        wire_money.prices_from_pb(s.prices),
    )


def spec_to_pb(s: SpecStats) -> routing_pb2.SpecOutcome:
    return routing_pb2.SpecOutcome(
        pair_id=s.pair_id,
        target_backend_id=s.target_id,
        rounds=s.rounds,
        drafted=s.drafted,
        accepted=s.accepted,
        repeated_ngram=s.repeated_ngram,
        schema_violation=s.schema_violation,
    )


def spec_from_pb(o: routing_pb2.RequestOutcome) -> SpecStats | None:
    if not o.HasField("spec"):
        return None
    s = o.spec
    return SpecStats(s.pair_id, s.target_backend_id, s.rounds, s.drafted, s.accepted,
                     s.repeated_ngram, s.schema_violation)  # fmt: skip


def failure_fields(failure: Failure) -> dict[str, Any]:
    """A failure class as a message carries it: the enum, and the string older controls
    read (they know no FailureClass)."""
    unspecified = routing_pb2.FAILURE_CLASS_UNSPECIFIED
    return {"failure": failure.value, "failure_class": FAILURE_TO_PB.get(failure, unspecified)}


def failure_from_pb(failure_class: int, failure: str) -> Failure:
    """The enum when the shim sent one, else the string of a shim that predates it."""
    known = FAILURE_FROM_PB.get(routing_pb2.FailureClass.ValueType(failure_class))
    return known if known is not None else Failure.parse(failure)


def failover_report_to_pb(r: FailoverReport) -> routing_pb2.ReportFailoverRequest:
    return routing_pb2.ReportFailoverRequest(
        request_id=r.request_id,
        trace_id=r.trace_id,
        tenant=r.tenant,
        from_backend_id=r.from_backend,
        to_backend_id=r.to_backend,
        **failure_fields(r.failure),
        choice_index=r.choice,
        tokens_sent=r.tokens_sent,
        path=PATH_TO_PB[r.path] if r.path else routing_pb2.RESUME_PATH_UNSPECIFIED,
        seam=SEAM_TO_PB[r.seam] if r.seam else routing_pb2.SEAM_VERDICT_UNSPECIFIED,
        gap_ms=r.gap_ms,
        attempt=r.attempt,
        outcome=FAILOVER_OUTCOME_TO_PB[r.outcome],
        detail=r.detail,
    )


def outcome_to_pb(o: RequestOutcome) -> routing_pb2.RequestOutcome:
    return routing_pb2.RequestOutcome(
        request_id=o.request_id,
        backend_id=o.backend_id,
        model=o.model,
        outcome=routing_pb2.OUTCOME_OK if o.ok else routing_pb2.OUTCOME_BACKEND_ERROR,
        http_status=o.http_status,
        ttft_ms=o.ttft_ms,
        total_ms=o.total_ms,
        reply_chain_hash=o.reply_chain_hash,
        message_count=o.message_count,
        spec=spec_to_pb(o.spec) if o.spec is not None else None,
        prompt_tokens=o.prompt_tokens,
        completion_tokens=o.completion_tokens,
        **(_blocks_fields(o.blocks) if o.blocks is not None else {}),
        cached_tokens=o.cached_tokens,
        tenant=o.tenant,
    )


def outcome_from_pb(o: routing_pb2.RequestOutcome) -> RequestOutcome:
    return RequestOutcome(
        request_id=o.request_id,
        backend_id=o.backend_id,
        model=o.model,
        ok=o.outcome == routing_pb2.OUTCOME_OK,
        http_status=o.http_status,
        ttft_ms=o.ttft_ms,
        total_ms=o.total_ms,
        reply_chain_hash=o.reply_chain_hash,
        message_count=o.message_count,
        spec=spec_from_pb(o),
        prompt_tokens=o.prompt_tokens,
        completion_tokens=o.completion_tokens,
        blocks=blocks_from_pb(o),
        cached_tokens=o.cached_tokens,
        tenant=o.tenant,
    )


def _blocks_fields(b: PrefixBlocks) -> dict[str, Any]:
    return {"prompt_chain_hash": b.prompt_chain_hash, "block_keys": b.keys,
            "prompt_blocks": b.prompt_blocks, "block_size": b.block_size}  # fmt: skip


def blocks_from_pb(o: routing_pb2.RequestOutcome) -> PrefixBlocks | None:
    if not o.block_keys or not o.block_size:
        return None
    return PrefixBlocks(o.prompt_chain_hash, tuple(o.block_keys), o.prompt_blocks, o.block_size)
