"""The only border between domain types and generated *_pb2 types on the control side."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from google.protobuf.timestamp_pb2 import Timestamp

from baton.v1 import admin_pb2, fleet_pb2, routing_pb2
from control.affinity import Pin
from control.events import Event, EventQuery
from control.model import (
    Backend,
    BackendId,
    BackendKind,
    BackendStatus,
    Decision,
    HealthState,
    Pairing,
    Reason,
    RequestShape,
    Role,
    RouteRequest,
    Snapshot,
)
from control.pairs import Pair, PairState, Verdict
from control.registry import GateResult
from control.routing import SpecStats

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
}


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
    )


def backend_fields_from_pb(b: fleet_pb2.Backend) -> dict[str, str]:
    """Raw fields for config.make_backend, which validates them; unset enums get defaults."""
    kind = KIND_FROM_PB.get(b.kind, BackendKind.VLLM)
    role = ROLE_FROM_PB.get(b.role, Role.SERVE)
    return {"id": b.id, "url": b.url, "model": b.model, "kind": kind.value, "role": role.value,
            "api_key_env": b.api_key_env, "reasoning_parser": b.reasoning_parser,
            "tool_parser": b.tool_parser}  # fmt: skip


def status_to_pb(s: BackendStatus, in_flight: Mapping[BackendId, int]) -> fleet_pb2.BackendStatus:
    return fleet_pb2.BackendStatus(
        backend=backend_to_pb(s.backend),
        state=STATE_TO_PB[s.health.state],
        reason=s.health.reason,
        since=timestamp(s.health.since),
        in_flight=in_flight.get(s.backend.id, 0),
        migrating=s.migrating,
    )


def snapshot_to_pb(s: Snapshot, in_flight: Mapping[BackendId, int]) -> fleet_pb2.Snapshot:
    return fleet_pb2.Snapshot(
        version=s.version, backends=[status_to_pb(b, in_flight) for b in s.backends]
    )


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
    )


def route_request_from_pb(
    request_id: str, shape: routing_pb2.RequestShape, exclude: tuple[str, ...] = ()
) -> RouteRequest:
    return RouteRequest(request_id, shape_from_pb(shape), frozenset(BackendId(e) for e in exclude))


def route_response(d: Decision) -> routing_pb2.RouteResponse:
    return routing_pb2.RouteResponse(
        backends=[backend_to_pb(b) for b in d.backends],
        reason=REASON_TO_PB[d.reason],
        snapshot_version=d.snapshot_version,
        detail=d.detail,
        pairing=pairing_to_pb(d.pairing) if d.pairing is not None else None,
    )


def failover_response(d: Decision) -> routing_pb2.FailoverResponse:
    return routing_pb2.FailoverResponse(
        backends=[backend_to_pb(b) for b in d.backends],
        reason=REASON_TO_PB[d.reason],
        snapshot_version=d.snapshot_version,
        detail=d.detail,
        pairing=pairing_to_pb(d.pairing) if d.pairing is not None else None,
    )


def pairing_to_pb(p: Pairing) -> routing_pb2.SpecPairing:
    return routing_pb2.SpecPairing(
        pair_id=p.pair_id,
        draft=backend_to_pb(p.draft),
        num_draft_tokens=p.num_draft_tokens,
        params_hash=p.params_hash,
        gate_required=p.gate_required,
        eos_token_id=p.eos_token_id,
    )


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


def spec_stats_from_pb(o: routing_pb2.RequestOutcome) -> SpecStats | None:
    if not o.HasField("spec"):
        return None
    s = o.spec
    return SpecStats(s.pair_id, s.target_backend_id, s.rounds, s.drafted, s.accepted,
                     s.repeated_ngram, s.schema_violation)  # fmt: skip


def timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


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


PATH_FROM_PB = {
    routing_pb2.RESUME_PATH_TOKEN: "token",
    routing_pb2.RESUME_PATH_TEXT: "text",
}
SEAM_FROM_PB = {
    routing_pb2.SEAM_VERDICT_VERIFIED: "verified",
    routing_pb2.SEAM_VERDICT_DIVERGENT: "divergent",
    routing_pb2.SEAM_VERDICT_UNCHECKED: "unchecked",
    routing_pb2.SEAM_VERDICT_SAMPLED: "sampled",
}
FAILOVER_OUTCOME_FROM_PB = {
    routing_pb2.FAILOVER_OUTCOME_RESUMED: "resumed",
    routing_pb2.FAILOVER_OUTCOME_REFUSED: "refused",
    routing_pb2.FAILOVER_OUTCOME_EXHAUSTED: "exhausted",
    routing_pb2.FAILOVER_OUTCOME_FAILED: "failed",
}


def failover_fields(r: routing_pb2.ReportFailoverRequest) -> dict[str, object]:
    """The failover event's body, from the shim's report."""
    return {
        "trace_id": r.trace_id,
        "from_backend": r.from_backend_id,
        "to_backend": r.to_backend_id,
        "failure": r.failure,
        "choice": r.choice_index,
        "tokens_sent": r.tokens_sent,
        "path": PATH_FROM_PB.get(r.path, "none"),
        "seam": SEAM_FROM_PB.get(r.seam, "none"),
        "gap_ms": round(r.gap_ms, 3),
        "attempt": r.attempt,
        "outcome": FAILOVER_OUTCOME_FROM_PB.get(r.outcome, "unknown"),
        "detail": r.detail,
    }


def pin_to_pb(p: Pin) -> admin_pb2.PinInfo:
    return admin_pb2.PinInfo(
        prefix=p.prefix,
        backend_id=p.backend_id,
        depth=p.depth,
        created=timestamp(p.created),
        last_used=timestamp(p.last_used),
        hits=p.hits,
    )
