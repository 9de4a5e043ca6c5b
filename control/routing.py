"""Control's per-request logic: ask the policy, account the load, take failure reports.
Thin on purpose: the decision is the policy's, the state is the registry's."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from random import Random

from control.events import EventKind
from control.model import BackendId, Decision, Reason, RouteRequest
from control.policy import Policy
from control.registry import Registry


@dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    backend_id: str
    ok: bool


class Router:
    def __init__(
        self, registry: Registry, policy: Policy, *, rng: Random, clock: Callable[[], float]
    ) -> None:
        self.registry = registry
        self.policy = policy
        self._rng = rng
        self._clock = clock

    def route(self, request: RouteRequest) -> Decision:
        now = self._clock()
        decision = self.policy.decide(
            request, self.registry.snapshot, self.registry.in_flight(), rng=self._rng, now=now
        )
        if decision.backends:
            self.registry.load.acquire(request.request_id, decision.backends[0].id, now)
        return decision

    def attempt_failed(self, request_id: str, backend_id: str, failure: str, detail: str) -> None:
        """Before the first byte: the shim retries on its next fallback."""
        self._demote(request_id, backend_id, failure, detail)
        self.registry.events.record(
            EventKind.RETRY,
            request_id=request_id,
            backend_id=backend_id,
            failure=failure,
            detail=detail,
        )

    def _demote(self, request_id: str, backend_id: str, failure: str, detail: str) -> None:
        reason = f"{failure}: {detail}" if detail else failure
        self.registry.report_failure(backend_id, reason)
        self.registry.load.release(request_id)

    def failover(
        self, request: RouteRequest, failed_backend_id: str, failure: str, detail: str = ""
    ) -> Decision:
        """A stream died mid-generation: demote its backend and pick another for the resume."""
        self._demote(request.request_id, failed_backend_id, failure, detail)
        excluded = request.exclude | {BackendId(failed_backend_id)}
        decision = self.route(replace(request, exclude=excluded))
        if decision.backends:
            decision = replace(decision, reason=Reason.FAILOVER)
        return decision

    def finished(self, outcomes: Iterable[Outcome]) -> None:
        for outcome in outcomes:
            self.registry.load.release(outcome.request_id)
