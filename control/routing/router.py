"""Control's per-request logic. A request is admitted (admission.py: routed now, queued or
refused), then routed in three steps: lookup (the fleet's state this request depends on),
decide (the policy's, then panic, then the pairing it may use: nothing written) and commit
(the pair change decided, load, pins, the prefill prediction, the audit: the only step that
writes). A stored object's follow-up is decided by its owner and committed the same way. A
failover routes the resume the same way too; what the shims report is learning.py's. The
fleet's state (load and pins included) is the registry's, the pairs' the pair flow's: the
router asks them, through their methods."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from baton.model import (
    BackendId,
    Decision,
    Failure,
    Reason,
    RequestOutcome,
    RouteRequest,
)
from baton.spread import Spreader, last_resort, prefer
from control.fleet.pins import PinMatch
from control.fleet.registry import Registry
from control.pairs.flow import NO_PAIRING, PairFlow, PairIntent
from control.routing.adapter_flow import AdapterFlow, LoadOrder, Parked, Steered, Wait
from control.routing.admission import AdmissionQueue, Admitted, Answer, Queued, Reply
from control.routing.learning import Learning
from control.routing.policy import Policy, RoutingView, look_up
from control.routing.policy.base import Prediction
from control.routing.prefill import Predicted, PrefillRates
from control.settings import AdmissionSettings, LoraSettings

# Decisions that put the request where its pinned prefix already is.
FOLLOWED_PIN = frozenset({Reason.PIN_HIT})


class Router:
    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        *,
        clock: Callable[[], float],
        route_events: bool = True,
        pairs: PairFlow | None = None,
        stale_after: float = 3.0,
        admission: AdmissionSettings | None = None,
        lora: LoraSettings | None = None,
        start_load: Callable[[LoadOrder], None] | None = None,
    ) -> None:
        """`pairs`: the control plane's one pair flow over `registry`; a router of its own
        (tests, benchmarks) gets a fresh one."""
        self._route_events = route_events
        self.registry = registry
        self.pairs = pairs if pairs is not None else PairFlow(registry)
        self._events = registry.events
        self.policy = policy
        # The spread counters the policies' rings come from (control/routing/policy/base.py).
        self._spread = Spreader()
        self._clock = clock
        self._stale_after = stale_after  # an engine's load reading older than this is unused
        self.prefill = PrefillRates()
        # Saturation: requests wait in priority bands, one queue per model (admission.py).
        self.admission = AdmissionQueue(
            registry, admission or AdmissionSettings(), stale_after=stale_after,
            chars_per_token=self.prefill.chars_per_token,
        )  # fmt: skip
        self.learning = Learning(registry, self.pairs, self.prefill)
        # Requests for LoRA adapters: placement, loads, and those waiting for one (`start_load`:
        # the plumbing's loader; control/routing/adapter_flow.py).
        self.adapters = AdapterFlow(registry, lora or LoraSettings(), start_load)
        self._loaded: list[Answer] = []  # answers of requests that waited for a load, unsent

    def now(self) -> float:
        """Control's clock, the one readings and pins are aged by."""
        return self._clock()

    def route(self, request: RouteRequest, *, reply: Reply | None = None) -> Decision:
        """Admit the request, then route it (or answer that it waits, or why not). `reply`:
        where its answer goes if it must wait (given back by `dequeue`)."""
        now = self._clock()
        door = self.admission.admit(request, now, reply)
        if isinstance(door, Admitted):
            return self._routed(door, now, reply)
        if isinstance(door, Queued):
            return door.decision
        if door.audit and self._route_events:
            self._audit(request, door.decision, None)
        return door.decision

    def _routed(self, admitted: Admitted, now: float, reply: Reply | None = None) -> Decision:
        request = admitted.request
        decision = self._route(request, None, (), now, reply)
        if decision.reason is Reason.QUEUED:
            return decision  # it waits for its adapter's load: still admitted
        if not decision.backends:
            self.registry.tenants.cancel(request.request_id)
        elif admitted.quota is not None:
            decision = replace(decision, quota=admitted.quota)
        return decision

    def dequeue(self) -> list[Answer]:
        """Queued requests whose turn came, routed now, and those shed: each with its answer
        and where it goes. Called whenever room may have freed (an outcome, a load reading, a
        tick)."""
        now = self._clock()
        out, self._loaded = self._loaded, []
        for late in self.adapters.expired(now):
            why = (f"adapter {late.request.shape.model!r} did not load within "
                   f"{self.adapters.settings.load_timeout:g} s")  # fmt: skip
            refused = Decision((), Reason.NO_BACKEND, self.registry.snapshot.version, why)
            out.append(self._answer_parked(late, refused))
        return out + self.admission.dequeue(
            now, lambda admitted, reply: self._routed(admitted, now, reply)
        )

    @property
    def waiting(self) -> bool:
        """Whether dequeue() may have answers to give (requests queued or waiting for an
        adapter's load, or answers unsent)."""
        return self.admission.waiting or bool(self._loaded) or self.adapters.parked > 0

    def adapter_loaded(self, backend_id: str, adapter: str, ok: bool, why: str = "") -> None:
        """A load `start_load` was ordered ended: the requests that waited for it are routed
        again (dequeue gives their answers)."""
        now = self._clock()
        for parked in self.adapters.loaded(backend_id, adapter, ok, now, why):
            decision = self._route(parked.request, parked.reason, parked.preferred, now,
                                   parked.reply)  # fmt: skip
            if decision.reason is not Reason.QUEUED:  # else it waits for another load
                self._loaded.append(self._answer_parked(parked, decision))

    def _answer_parked(self, parked: Parked, decision: Decision) -> Answer:
        if not decision.backends:
            self.registry.release(parked.request.request_id)
            if parked.reason is None:
                self.registry.tenants.cancel(parked.request.request_id)
        return Answer(parked.request.request_id, decision, parked.reply)

    def queued_by_band(self) -> dict[str, int]:
        """Requests waiting now, by their class's name (for /metrics)."""
        return self.admission.queued_by_band()

    # -- lookup, decide, commit -------------------------------------------------------------

    def _route(
        self, request: RouteRequest, reason: Reason | None, preferred: Sequence[str], now: float,
        reply: Reply | None = None,
    ) -> Decision:  # fmt: skip
        """`reply`: where the answer goes if the request must wait for its adapter's load."""
        if request.shape.owner_key:
            decision = self._to_owner(request, now)
            self._commit(request, None, decision, NO_PAIRING, learn=False, now=now)
            return decision
        steer = self.adapters.steer(request, now, resume=reason is Reason.FAILOVER)
        if isinstance(steer, Wait):
            self.adapters.done(request.request_id)  # a resume: it left the failed backend
            self.adapters.park(steer, Parked(request, reason, tuple(preferred), reply, now))
            # It counts on the backend it waits for: admission and placement see it there.
            self.registry.acquire(request.request_id, steer.backend, now)
            why = f"loading adapter {steer.adapter!r} on {steer.backend}"
            return Decision((), Reason.QUEUED, self.registry.snapshot.version, why,
                            wait_s=self.adapters.settings.load_timeout)  # fmt: skip
        if isinstance(steer, Decision):
            self._commit(request, None, steer, NO_PAIRING, learn=False, now=now)
            return steer
        if isinstance(steer, Steered):
            request = steer.request
        pin = self._pin(request, now)
        found = self._lookup(request, pin, now)
        decision, intent = self._decide(request, found, reason, preferred)
        self._commit(request, pin, decision, intent, learn=reason is None, now=now)
        return decision

    def _lookup(
        self, request: RouteRequest, pin: PinMatch | None, now: float
    ) -> RoutingView | Decision:
        """The view the policy decides over (candidates and ring included), or the refusal
        when no backend can take the request."""
        reg = self.registry
        predict = self._prediction(request, now) if self.policy.predicts else None
        return look_up(request, reg.snapshot, reg.in_flight(), self._spread, pin, predict)

    def _decide(
        self,
        request: RouteRequest,
        found: RoutingView | Decision,
        reason: Reason | None,
        preferred: Sequence[str],
    ) -> tuple[Decision, PairIntent]:
        """The decision, and what it means for the pairs (applied by commit)."""
        if isinstance(found, RoutingView):
            decision = prefer(self.policy.decide(request, found), preferred)
        else:
            decision = found
        if not decision.backends and decision.reason is Reason.NO_BACKEND:
            decision = self._panic(request, decision)
        if not decision.backends:
            return decision, NO_PAIRING
        if reason is not None:
            decision = replace(decision, reason=reason)
        if not (len(self.pairs) and request.shape.spec_eligible):  # no pair: nothing to ask
            return decision, NO_PAIRING
        intent = self.pairs.pairing_for(decision.backends[0], request.shape)
        if intent.pairing is not None:
            decision = replace(decision, pairing=intent.pairing)
        return decision, intent

    def _commit(
        self, request: RouteRequest, match: PinMatch | None, decision: Decision,
        intent: PairIntent, *, learn: bool, now: float,
    ) -> None:  # fmt: skip
        """`learn`: the request's first token is what this route waits for (a failover's
        resume is not: nothing to learn from it)."""
        if intent is not NO_PAIRING:
            self.pairs.apply(intent)
        reg, shape = self.registry, request.shape
        if decision.backends:
            primary = decision.backends[0].id
            reg.acquire(request.request_id, primary, now)
            self.adapters.used(request, primary, now)
            if decision.reason is not Reason.OWNER:
                self._place(request, match, decision, now)
            est = decision.estimate
            if learn and est is not None and est.backend_id == primary:
                backlog = self.prefill.backlog_tokens(primary, now)
                guess = Predicted(primary, est.uncached_tokens, backlog, est.outside,
                                  shape.prompt_chars, shape.model)  # fmt: skip
                self.prefill.predicted(request.request_id, guess, now)
        if self._route_events:
            self._audit(request, decision, match)

    def _place(
        self, request: RouteRequest, match: PinMatch | None, decision: Decision, now: float
    ) -> None:
        """Pins: wherever the request goes, that backend's cache now holds its prefix. (A
        stored object's follow-up is not placed: its owner was a fact already.)"""
        reg, shape, primary = self.registry, request.shape, decision.backends[0].id
        if match is not None and decision.reason in FOLLOWED_PIN:
            reg.placement.follow_pin(match, now)
        reg.placement.pin_chain(shape.prefix_chain, primary, now)
        if shape.session:
            reg.placement.pin_session(shape.session, primary, now)

    def _pin(self, request: RouteRequest, now: float) -> PinMatch | None:
        """The request's session pin (it covers the whole conversation), else its longest
        pinned prefix."""
        shape, reg = request.shape, self.registry
        if shape.session:
            match = reg.placement.session_pin(shape.session, now)
            if match is not None:
                return PinMatch(match.pin, max(len(shape.prefix_chain) - 1, 0))
        return reg.placement.longest_pin(shape.prefix_chain, now) if shape.prefix_chain else None

    def _prediction(self, request: RouteRequest, now: float) -> Prediction:
        loads = self.registry.load_views(now, self._stale_after)
        cached, prompt_tokens = self.registry.cached_tokens(request.shape)
        return Prediction(
            backlog_ms={bid: self.prefill.backlog_ms(bid, now) for bid in loads},
            outside={bid: lv.outside() for bid, lv in loads.items()},
            cached_tokens=cached,
            rates={bid: self.prefill.rates(bid) for bid in loads},
            prompt_tokens=prompt_tokens,
            chars_per_token=self.prefill.chars_per_token(request.shape.model),
        )

    def _to_owner(self, request: RouteRequest, now: float) -> Decision:
        """A follow-up of a stored object goes to the backend that holds it, or nowhere:
        another engine would answer a misleading 404. No fallbacks: none holds it."""
        key = request.shape.owner_key
        reg = self.registry
        version = reg.snapshot.version
        owned = reg.placement.owner_of(key, now)
        if owned is None:
            why = (f"no backend is known to hold {key} (it was not stored through this "
                   "fleet's router, or was deleted, or its ownership pin aged out)")  # fmt: skip
            return Decision((), Reason.OWNER_UNKNOWN, version, why)
        status = reg.snapshot.get(owned.backend_id)
        if status is not None and status.routable and owned.backend_id not in request.exclude:
            return Decision((status.backend,), Reason.OWNER, version)
        state = "removed" if status is None else status.health.state.value
        why = f"{key} is stored on backend {owned.backend_id}, which is {state}"
        return Decision((), Reason.OWNER_GONE, version, why)

    def record_owner(self, key: str, backend_id: str, model: str) -> None:
        """A shim saw `backend_id` store `key` (before the client could learn the id)."""
        self.registry.placement.record_owner(key, BackendId(backend_id), model, self._clock())

    def release_owner(self, key: str) -> None:
        """A shim saw `key` deleted on its owner."""
        self.registry.placement.release_owner(key)

    def _panic(self, request: RouteRequest, refused: Decision) -> Decision:
        """No healthy backend serves the model: rather than refuse, try the ones health took
        out (baton/spread.py: last_resort, the shim's degraded mode's order too)."""
        tried = last_resort(request, self.registry.snapshot)
        if not tried:
            return refused
        return Decision(tried, Reason.DEGRADED, refused.snapshot_version,
                        f"panic: {refused.detail}; trying them anyway")  # fmt: skip

    def _audit(self, request: RouteRequest, decision: Decision, match: PinMatch | None) -> None:
        self._events.record_route(
            request.request_id,
            backend_id=decision.backends[0].id if decision.backends else "",
            reason=decision.reason.value,
            policy=self.policy.name,
            model=request.shape.model,
            pin_depth=match.index + 1 if match else 0,
            snapshot=decision.snapshot_version,
            detail=decision.detail,
            tenant=request.shape.tenant,
        )

    # -- failover and reports -----------------------------------------------------------------

    def failover(
        self,
        request: RouteRequest,
        failed_backend_id: str,
        failure: Failure,
        detail: str = "",
        preferred: Sequence[str] = (),
        pair_id: str = "",
        reply: Reply | None = None,
    ) -> Decision:
        """A stream died mid-generation: demote its backend and pick another for the resume
        (the first of `preferred`, the route's own remaining fallbacks, still routable), not
        admitted again (it was once). A speculative request's draft is re-paired with the new
        backend, pending the gate."""
        if failure is Failure.MIGRATE:
            # A planned hand-over off a draining backend, not a fault: don't demote it.
            self.registry.release(request.request_id)
        else:
            self.learning.demote(request.request_id, failed_backend_id, failure, detail)
        excluded = request.exclude | {BackendId(failed_backend_id)}
        request = replace(request, exclude=excluded)
        if pair_id:
            # The pairing question is the gate's, not the policy's: route as target-only.
            request = replace(request, shape=replace(request.shape, spec_eligible=False))
        decision = self._route(request, Reason.FAILOVER, preferred, self._clock(), reply)
        if pair_id and decision.backends:
            pairing = self.pairs.repair(pair_id, decision.backends[0].id, failed_backend_id)
            decision = replace(decision, pairing=pairing)
        return decision

    def attempt_failed(
        self, request_id: str, backend_id: str, failure: Failure, detail: str
    ) -> None:
        """Before the first byte: the shim retries on its next fallback."""
        self.learning.attempt_failed(request_id, backend_id, failure, detail)

    def finished(self, outcomes: Iterable[RequestOutcome]) -> None:
        """Requests' ends: one still waiting is dropped (its client left); the others'
        outcomes are learned from."""
        outcomes = list(outcomes)
        for outcome in outcomes:
            self.admission.left(outcome.request_id)
            self.adapters.done(outcome.request_id)
            if self.adapters.parked:
                self.adapters.left(outcome.request_id)
        self.learning.finished(outcomes, self._clock())
