"""The whole policy contract. Policies are pure and synchronous: no I/O, no clock or global
randomness (both come in as arguments), and they never raise for "no capacity"."""

from __future__ import annotations

from collections.abc import Mapping
from random import Random
from typing import Protocol

from control.model import BackendId, BackendStatus, Decision, Reason, RouteRequest, Snapshot


class Policy(Protocol):
    name: str

    def decide(
        self,
        request: RouteRequest,
        snapshot: Snapshot,
        load: Mapping[BackendId, int],
        *,
        rng: Random,
        now: float,
    ) -> Decision: ...


def candidates(
    request: RouteRequest, snapshot: Snapshot
) -> tuple[tuple[BackendStatus, ...], Decision | None]:
    """Routable backends for the request's model, minus its exclusions; or the refusal
    every policy gives when there are none."""
    serving = snapshot.serving(request.shape.model)
    if not serving:
        return (), Decision(
            (),
            Reason.UNKNOWN_MODEL,
            snapshot.version,
            f"no backend serves model {request.shape.model!r}",
        )
    routable = tuple(b for b in serving if b.routable and b.backend.id not in request.exclude)
    if not routable:
        states = ", ".join(f"{b.backend.id}={b.health.state}" for b in serving)
        return (), Decision(
            (),
            Reason.NO_BACKEND,
            snapshot.version,
            f"no routable backend for {request.shape.model!r} ({states})",
        )
    return routable, None
