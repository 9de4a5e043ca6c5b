"""Control's per-request logic: look up the request's pin, ask the policy, account load and
pins, take failure and outcome reports. Thin on purpose: the decision is the policy's, the
fleet's state (load and pins included) is the registry's, the pairs' the pair flow's; the
router only asks them, through their methods."""

# baton: pure

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from random import Random

from baton.ledger import ADMITTED, Admission
from baton.model import (
    BackendId,
    Decision,
    Failure,
    Reason,
    RequestOutcome,
    RouteRequest,
)
from baton.spread import last_resort, prefer
from baton.tenancy import Priority, Quota
from control.audit.payloads import Retry
from control.fleet.pins import PinMatch
from control.fleet.registry import Registry
from control.pairs.flow import PairFlow
from control.routing.bands import Bands, Waiting
from control.routing.policy import Policy, RoutingView
from control.routing.policy.base import Prediction
from control.routing.prefill import Predicted, PrefillRates
from control.settings import AdmissionSettings


@dataclass(frozen=True, slots=True)
class _Queued:
    request: RouteRequest
    quota: Quota | None  # the tenant's standing at its admission, for its answer's headers


# Decisions that put the request where its pinned prefix already is.
FOLLOWED_PIN = frozenset({Reason.PIN_HIT})


class Router:
    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        *,
        rng: Random,
        clock: Callable[[], float],
        route_events: bool = True,
        pairs: PairFlow | None = None,
        stale_after: float = 3.0,
        admission: AdmissionSettings | None = None,
    ) -> None:
        """`pairs`: the control plane's one pair flow over `registry`; a router of its own
        (tests, benchmarks) gets a fresh one."""
        self._route_events = route_events
        self.registry = registry
        self.pairs = pairs if pairs is not None else PairFlow(registry)
        self._events = registry.events
        self.policy = policy
        self._rng = rng
        self._clock = clock
        self._stale_after = stale_after  # an engine's load reading older than this is unused
        self.prefill = PrefillRates()
        # Saturation: requests wait in priority bands, one queue per model (bands.py).
        self.admission = admission or AdmissionSettings()
        self._queues: dict[str, Bands[_Queued]] = {}
        self._decided: list[tuple[str, Decision]] = []  # answers of queued requests, not yet sent

    def now(self) -> float:
        """Control's clock, the one readings and pins are aged by."""
        return self._clock()

    def route(
        self,
        request: RouteRequest,
        *,
        reason: Reason | None = None,
        preferred: Sequence[str] = (),
    ) -> Decision:
        """Lookup (the fleet's state this request depends on), decide (the policy's, then
        panic and pairing), commit (load, pins, the prefill prediction, the audit). Only
        commit writes."""
        now = self._clock()
        if reason is not None:  # a failover's resume: its request was admitted already
            return self._route(request, reason, preferred, now)
        shape = request.shape
        queueing = self.admission.enabled and not shape.owner_key
        if not (shape.tenant or queueing):  # an open shim's request, no bands: route it
            return self._routed(request, ADMITTED, now)
        # What it may cost, at the model's learned characters per token.
        tokens = shape.tokens_estimate(self.prefill.chars_per_token(shape.model))
        admitted = self.registry.tenants.admit(
            request.request_id, shape.tenant, shape.model, tokens, now
        )
        if admitted.refused is not None:
            refusal = Decision((), admitted.refused, self.registry.snapshot.version,
                               admitted.detail, quota=admitted.quota)  # fmt: skip
            if self._route_events:
                self._audit(request, refusal, None)
            return refusal
        if queueing:
            queued = self._wait_for_room(request, admitted, tokens, now)
            if queued is not None:
                return queued
            request = self._away_from_full(request, self._band(request), now)
        return self._routed(request, admitted, now)

    def _routed(self, request: RouteRequest, admitted: Admission, now: float) -> Decision:
        decision = self._route(request, None, (), now)
        if not decision.backends:
            self.registry.tenants.cancel(request.request_id)
        elif admitted.quota is not None:
            decision = replace(decision, quota=admitted.quota)
        return decision

    # -- saturation: priority bands ---------------------------------------------------------

    def _band(self, request: RouteRequest) -> int:
        tenant = self.registry.tenants.find(request.shape.tenant)
        return (tenant.priority if tenant is not None else Priority.STANDARD).band

    def _full(self, model: str, band: int, now: float) -> tuple[set[BackendId], int]:
        """The model's routable backends that are full for `band`, and how many are
        routable. Full: Baton's requests on it reach the band's share of its capacity, or
        its engine's fresh reading says requests wait in its own queue."""
        cap = self.admission.capacity(band)
        counts = self.registry.in_flight()
        full, routable = set(), 0
        for s in self.registry.snapshot.serving(model):
            if not s.routable:
                continue
            routable += 1
            bid = s.backend.id
            load = self.registry.engine_load(bid)
            queueing = (load is not None and load.waiting > 0
                        and now - load.read_at <= self._stale_after)  # fmt: skip
            if counts.get(bid, 0) >= cap or queueing:
                full.add(bid)
        return full, routable

    def _away_from_full(self, request: RouteRequest, band: int, now: float) -> RouteRequest:
        full, _ = self._full(request.shape.model, band, now)
        return replace(request, exclude=request.exclude | full) if full else request

    def _wait_for_room(
        self, request: RouteRequest, admitted: Admission, tokens: int, now: float
    ) -> Decision | None:
        """A QUEUED answer when the request must wait: every routable backend is full for
        its band, or requests of its band or a higher one wait already (they go first).
        None: route it now. No backend routable at all: not a wait (route as ever)."""
        model, band = request.shape.model, self._band(request)
        q = self._queues.get(model)
        ahead = q is not None and q.waiting_at_or_above(band)
        full, routable = self._full(model, band, now)
        if not routable or not (ahead or len(full) >= routable):
            return None
        q = self._queues.setdefault(model, Bands())
        version = self.registry.snapshot.version
        if len(q) >= self.admission.max_queued:
            victim = q.lowest_newest()
            if victim is None or victim.band <= band:
                self.registry.tenants.waited(request.shape.tenant, 0.0, True, now)
                return self._shed(request.request_id, version, "the queue is full")
            q.remove(victim.request_id)
            self.registry.tenants.waited(victim.tenant, now - victim.since, True, now)
            self._decided.append((victim.request_id, self._shed(
                victim.request_id, version, "a higher band's request took its place")))  # fmt: skip
        tenant = self.registry.tenants.find(request.shape.tenant)
        wait = self.admission.max_wait
        weight = tenant.weight if tenant is not None else 1
        q.push(Waiting(request.request_id, request.shape.tenant, band, weight, max(tokens, 1),
                       now, now + wait, _Queued(request, admitted.quota)))  # fmt: skip
        return Decision((), Reason.QUEUED, version,
                        f"fleet saturated: waiting in band {band}", quota=admitted.quota,
                        wait_s=wait)  # fmt: skip

    def _shed(self, request_id: str, version: int, why: str) -> Decision:
        self.registry.tenants.cancel(request_id)
        return Decision((), Reason.SHED, version, f"fleet saturated: {why}",
                        wait_s=self.admission.max_wait)  # fmt: skip

    def dequeue(self) -> list[tuple[str, Decision]]:
        """Queued requests whose turn came, routed now, and those shed (their wait reached
        its bound, or the queue was full): each with its answer. Called whenever room may
        have freed (an outcome, a load reading, a tick)."""
        now = self._clock()
        out, self._decided = self._decided, []
        version = self.registry.snapshot.version
        for model, q in list(self._queues.items()):
            for late in q.expired(now):
                why = f"no room within {self.admission.max_wait:g} s"
                self.registry.tenants.waited(late.tenant, now - late.since, True, now)
                out.append((late.request_id, self._shed(late.request_id, version, why)))
            while len(q):
                w = q.pop(functools.partial(self._has_room, model, now=now))
                if w is None:
                    break
                self.registry.tenants.waited(w.tenant, now - w.since, False, now)
                request = self._away_from_full(w.item.request, w.band, now)
                admitted = Admission(quota=w.item.quota)
                out.append((w.request_id, self._routed(request, admitted, now)))
            if not len(q):
                del self._queues[model]
        return out

    def _has_room(self, model: str, band: int, *, now: float) -> bool:
        full, routable = self._full(model, band, now)
        return len(full) < routable

    def queued_by_band(self) -> dict[str, int]:
        """Requests waiting now, by their class's name (for /metrics)."""
        out = {p.value: 0 for p in Priority}
        names = {p.band: p.value for p in Priority}
        for q in self._queues.values():
            for band, n in q.sizes().items():
                out[names[band]] += n
        return out

    @property
    def waiting(self) -> bool:
        """Whether dequeue() may have answers to give (requests queued, or shed unsent)."""
        return bool(self._queues or self._decided)

    def _unqueue(self, request_id: str) -> None:
        """A queued request whose client left (its shim reported its end)."""
        for q in self._queues.values():
            if q.remove(request_id) is not None:
                return

    def _route(
        self, request: RouteRequest, reason: Reason | None, preferred: Sequence[str], now: float
    ) -> Decision:
        if request.shape.owner_key:
            return self._to_owner(request, now)
        view = self._lookup(request, now)
        decision = self._decide(request, view, reason, preferred, now)
        self._commit(request, view, decision, learn=reason is None, now=now)
        return decision

    def _lookup(self, request: RouteRequest, now: float) -> RoutingView:
        reg = self.registry
        predict = self._prediction(request, now) if self.policy.predicts else None
        return RoutingView(reg.snapshot, reg.in_flight(), self._pin(request, now), predict)

    def _decide(
        self,
        request: RouteRequest,
        view: RoutingView,
        reason: Reason | None,
        preferred: Sequence[str],
        now: float,
    ) -> Decision:
        decision = prefer(self.policy.decide(request, view, rng=self._rng, now=now), preferred)
        if not decision.backends and decision.reason is Reason.NO_BACKEND:
            decision = self._panic(request, decision)
        if not decision.backends:
            return decision
        if reason is not None:
            decision = replace(decision, reason=reason)
        if self.pairs and request.shape.spec_eligible:
            pairing = self.pairs.pairing_for(decision.backends[0], request.shape)
            if pairing is not None:
                decision = replace(decision, pairing=pairing)
        return decision

    def _commit(
        self, request: RouteRequest, view: RoutingView, decision: Decision, *, learn: bool,
        now: float,
    ) -> None:  # fmt: skip
        """`learn`: the request's first token is what this route waits for (a failover's
        resume is not: nothing to learn from it)."""
        reg, shape, match = self.registry, request.shape, view.pin
        if decision.backends:
            primary = decision.backends[0].id
            reg.acquire(request.request_id, primary, now)
            if match is not None and decision.reason in FOLLOWED_PIN:
                reg.placement.follow_pin(match, now)
            # Wherever it goes, that backend's cache now holds this prefix.
            reg.placement.pin_chain(shape.prefix_chain, primary, now)
            if shape.session:
                reg.placement.pin_session(shape.session, primary, now)
            est = decision.estimate
            if learn and est is not None and est.backend_id == primary:
                backlog = self.prefill.backlog_tokens(primary, now)
                guess = Predicted(primary, est.uncached_tokens, backlog, est.outside,
                                  shape.prompt_chars, shape.model)  # fmt: skip
                self.prefill.predicted(request.request_id, guess, now)
        if self._route_events:
            self._audit(request, decision, match)

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
            decision = Decision((), Reason.OWNER_UNKNOWN, version, why)
        else:
            status = reg.snapshot.get(owned.backend_id)
            if status is not None and status.routable and owned.backend_id not in request.exclude:
                reg.acquire(request.request_id, BackendId(owned.backend_id), now)
                decision = Decision((status.backend,), Reason.OWNER, version)
            else:
                state = "removed" if status is None else status.health.state.value
                why = f"{key} is stored on backend {owned.backend_id}, which is {state}"
                decision = Decision((), Reason.OWNER_GONE, version, why)
        if self._route_events:
            self._audit(request, decision, None)
        return decision

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
            decision.backends[0].id if decision.backends else "",
            decision.reason.value,
            self.policy.name,
            request.shape.model,
            match.index + 1 if match else 0,
            decision.snapshot_version,
            decision.detail,
            request.shape.tenant,
        )

    def attempt_failed(
        self, request_id: str, backend_id: str, failure: Failure, detail: str
    ) -> None:
        """Before the first byte: the shim retries on its next fallback."""
        self._demote(request_id, backend_id, failure, detail)
        self._events.record(
            Retry(failure=failure.value, detail=detail),
            request_id=request_id,
            backend_id=backend_id,
        )

    def _demote(self, request_id: str, backend_id: str, failure: Failure, detail: str) -> None:
        reason = f"{failure}: {detail}" if detail else failure
        self.registry.report_failure(backend_id, reason)
        self.registry.release(request_id)

    def failover(
        self,
        request: RouteRequest,
        failed_backend_id: str,
        failure: Failure,
        detail: str = "",
        preferred: Sequence[str] = (),
        pair_id: str = "",
    ) -> Decision:
        """A stream died mid-generation: demote its backend and pick another for the resume
        (the first of `preferred`, the route's own remaining fallbacks, still routable). A
        speculative request's draft is re-paired with the new backend, pending the gate."""
        if failure is Failure.MIGRATE:
            # A planned hand-over off a draining backend, not a fault: don't demote it.
            self.registry.release(request.request_id)
        else:
            self._demote(request.request_id, failed_backend_id, failure, detail)
        excluded = request.exclude | {BackendId(failed_backend_id)}
        request = replace(request, exclude=excluded)
        if pair_id:
            # The pairing question is the gate's, not the policy's: route as target-only.
            request = replace(request, shape=replace(request.shape, spec_eligible=False))
        decision = self.route(request, reason=Reason.FAILOVER, preferred=preferred)
        if pair_id and decision.backends:
            pairing = self.pairs.repair(pair_id, decision.backends[0].id, failed_backend_id)
            decision = replace(decision, pairing=pairing)
        return decision

    def finished(self, outcomes: Iterable[RequestOutcome]) -> None:
        now = self._clock()
        tenants = self.registry.tenants
        for outcome in outcomes:
            if self._queues:
                self._unqueue(outcome.request_id)
            self.registry.release(outcome.request_id)
            tenants.finished(
                outcome.request_id, outcome.prompt_tokens, outcome.completion_tokens, now,
                refused=outcome.engine_refused,
            )  # fmt: skip
            if outcome.ok and outcome.ttft_ms > 0:
                self.prefill.observed(outcome.request_id, outcome.backend_id, outcome.ttft_ms,
                                      outcome.prompt_tokens)  # fmt: skip
            if outcome.ok and outcome.blocks is not None:
                self.registry.placement.learn_blocks(
                    outcome.blocks, outcome.reply_chain_hash, outcome.prompt_tokens
                )
            if (s := outcome.spec) is not None:
                flags = [n for n, bad in (("repeated n-gram loop", s.repeated_ngram),
                                          ("schema violation", s.schema_violation)) if bad]
                self.pairs.spec_outcome(s.pair_id, s.target_id, s.rounds, s.drafted,
                                        s.accepted, not flags, ", ".join(flags))  # fmt: skip
            if outcome.ok and outcome.reply_chain_hash and outcome.backend_id:
                # The next turn's prefix ends with this reply: pin it where it was generated.
                self.registry.placement.pin_reply(
                    outcome.reply_chain_hash,
                    BackendId(outcome.backend_id),
                    outcome.message_count + 1,
                    now,
                )
