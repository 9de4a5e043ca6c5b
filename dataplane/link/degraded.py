"""Degraded routing (docs/architecture.md#when-control-is-unreachable): what a shim decides on its
own while control is unreachable.

Pure: the last snapshot control published is the only input. Pins and load live in control
and are not known here, so the shim only spreads: round robin over the snapshot's healthy
backends serving the model (drafts excluded: they serve only through a pair, and pairs need
control's gate). Every decision is marked `degraded`."""

# baton: pure

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from baton.model import (
    BackendId,
    Decision,
    Reason,
    RequestShape,
    RouteRequest,
    Snapshot,
)
from baton.spread import Spreader, candidates, last_resort, prefer


class DegradedRouter:
    """Reads: one snapshot (the last control sent) and the request's model.
    Returns: the healthy backends serving the model minus `exclude`, rotated so the primary
    advances by one per decision (the same ring control's round robin builds); a failover
    moves the first still-fit of `preferred` to the front. No backend: a NO_BACKEND or
    UNKNOWN_MODEL decision, never an exception. Ties: none, the counter alone decides."""

    def __init__(self) -> None:
        self._spread = Spreader()

    def route(
        self,
        snapshot: Snapshot,
        model: str,
        *,
        exclude: Collection[str] = (),
        preferred: Sequence[str] = (),
    ) -> Decision:
        request = RouteRequest("", RequestShape(model), frozenset(BackendId(b) for b in exclude))
        routable, refusal = candidates(request, snapshot)
        # The snapshot ages while control is away: a backend it calls down may be back and the
        # healthy ones may have died since. Those health took out go last, in control's panic
        # order, so a request tries them before it fails.
        tried_last = last_resort(request, snapshot)
        if refusal is not None:
            if refusal.reason is Reason.NO_BACKEND and tried_last:
                return Decision(
                    tried_last,
                    Reason.DEGRADED,
                    snapshot.version,
                    f"control plane unreachable; snapshot v{snapshot.version} has no healthy "
                    "backend: trying the ones it called down",
                )
            return Decision(
                (),
                refusal.reason,
                snapshot.version,
                f"control plane unreachable; from snapshot v{snapshot.version}: {refusal.detail}",
            )
        ring = self._spread.ring(model, routable)
        decision = Decision(
            ring,
            Reason.DEGRADED,
            snapshot.version,
            f"control plane unreachable; round robin over snapshot v{snapshot.version}",
        )
        decision = prefer(decision, preferred) if preferred else decision
        return replace(decision, backends=decision.backends + tried_last)
