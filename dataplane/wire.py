"""The shim's border with the generated *_pb2 types: control's answers and snapshots into
domain types, the shim's requests and reports into messages. (control/services/convert.py is
control's side of the same border; its tables are reused, inverted.)"""

from __future__ import annotations

from baton.v1 import fleet_pb2, routing_pb2
from control.model import (
    BackendStatus,
    Decision,
    Health,
    HealthState,
    Pairing,
    Reason,
    RequestShape,
    Snapshot,
)
from control.routing import SpecStats
from control.services import convert

REASON_FROM_PB = {v: k for k, v in convert.REASON_TO_PB.items()}
STATE_FROM_PB = {v: k for k, v in convert.STATE_TO_PB.items()}
PATH_TO_PB = {v: k for k, v in convert.PATH_FROM_PB.items()}
SEAM_TO_PB = {v: k for k, v in convert.SEAM_FROM_PB.items()}
OUTCOME_TO_PB = {v: k for k, v in convert.FAILOVER_OUTCOME_FROM_PB.items()}
VERDICT_FROM_PB = {v: k.value for k, v in convert.VERDICT_TO_PB.items()}


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
    )


def decision_from_pb(resp: routing_pb2.RouteResponse | routing_pb2.FailoverResponse) -> Decision:
    return Decision(
        tuple(convert.backend_from_pb(b) for b in resp.backends),
        REASON_FROM_PB.get(resp.reason, Reason.NO_BACKEND),
        resp.snapshot_version,
        resp.detail,
        pairing_from_pb(resp.pairing) if resp.HasField("pairing") else None,
    )


def pairing_from_pb(p: routing_pb2.SpecPairing) -> Pairing:
    return Pairing(
        p.pair_id,
        convert.backend_from_pb(p.draft),
        p.num_draft_tokens,
        p.params_hash,
        p.gate_required,
        p.eos_token_id if p.HasField("eos_token_id") else None,
    )


def snapshot_from_pb(s: fleet_pb2.Snapshot) -> Snapshot:
    """What degraded routing needs: every backend with its health. An unknown state is
    taken as DOWN, so a newer control's new state never makes a backend routable here."""
    return Snapshot(
        s.version,
        tuple(
            BackendStatus(
                convert.backend_from_pb(b.backend),
                Health(
                    STATE_FROM_PB.get(b.state, HealthState.DOWN),
                    b.reason,
                    b.since.ToNanoseconds() / 1e9,
                ),
                b.migrating,
            )
            for b in s.backends
        ),
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
