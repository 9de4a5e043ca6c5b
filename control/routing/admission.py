"""Admission: whether a request is routed now, waits for room, or is refused, and the one
place where the requests that wait are kept until their answers go out.

A tenant's request is admitted by its tenant's limits (baton/ledger.py, through the
registry's TenantBook). With `[admission]` on, a request that finds every routable backend
of its model full for its band (or requests of its band or a higher one waiting already)
waits in that model's priority bands (bands.py); `dequeue` routes the waiting ones as room
frees, sheds those whose wait reached its bound, and hands each answer back with where it
goes (`Reply`: the plumbing's own way back to the shim, kept here and never called here)."""

# baton: pure

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from baton.ledger import Admission
from baton.model import BackendId, Decision, Reason, RouteRequest
from baton.tenancy import Priority, Quota
from control.fleet.registry import Registry
from control.routing.bands import Bands, Waiting
from control.settings import AdmissionSettings

# Where a queued request's answer goes: the plumbing's callable (control/api/routing.py: the
# stream the request came on). Admission keeps it beside the request and gives it back with
# the answer; what it takes is the plumbing's business.
Reply = Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class Admitted:
    """Route it now: `request` steered away from the backends full for its band."""

    request: RouteRequest
    quota: Quota | None = None  # the tenant's standing, for its answer's headers


@dataclass(frozen=True, slots=True)
class Queued:
    """It waits for room: `decision` (QUEUED) is the answer now, the real one comes from
    `dequeue`."""

    decision: Decision


@dataclass(frozen=True, slots=True)
class Refused:
    """Not routed: the tenant's limits refused it (`audit`: the audit log records it, as a
    routing decision), or the queue is full and it is shed (a saturated queue's answer, not
    a decision over the fleet: not recorded)."""

    decision: Decision
    audit: bool = True


@dataclass(frozen=True, slots=True)
class Answer:
    """A queued request's answer, and where it goes (None: nowhere waits for it)."""

    request_id: str
    decision: Decision
    reply: Reply | None = None


@dataclass(frozen=True, slots=True)
class _Queued:
    request: RouteRequest
    quota: Quota | None  # the tenant's standing at its admission, for its answer's headers


class AdmissionQueue:
    def __init__(
        self,
        registry: Registry,
        settings: AdmissionSettings,
        *,
        stale_after: float,
        chars_per_token: Callable[[str], float],
    ) -> None:
        """`chars_per_token`: a model's learned characters per token (control/routing/
        prefill.py), what a request may cost is estimated at."""
        self._registry = registry
        self.settings = settings
        self._stale_after = stale_after  # an engine's load reading older than this is unused
        self._chars_per_token = chars_per_token
        self._queues: dict[str, Bands[_Queued]] = {}  # one per model
        self._decided: list[tuple[str, Decision]] = []  # answers of queued requests, not yet sent
        self._replies: dict[str, Reply] = {}

    def admit(
        self, request: RouteRequest, now: float, reply: Reply | None = None
    ) -> Admitted | Queued | Refused:
        """`reply`: where the request's answer goes if it must wait."""
        shape = request.shape
        queueing = self.settings.enabled and not shape.owner_key
        if not (shape.tenant or queueing):  # an open shim's request, no bands: route it
            return Admitted(request)
        # What it may cost, at the model's learned characters per token.
        tokens = shape.tokens_estimate(self._chars_per_token(shape.model))
        admitted = self._registry.tenants.admit(
            request.request_id, shape.tenant, shape.model, tokens, now, shape.max_tokens
        )
        if admitted.refused is not None:
            return Refused(Decision((), admitted.refused, self._registry.snapshot.version,
                                    admitted.detail, quota=admitted.quota))  # fmt: skip
        if not queueing:
            return Admitted(request, admitted.quota)
        waits = self._wait_for_room(request, admitted, tokens, now)
        if waits is None:
            request = self._away_from_full(request, self._band(request), now)
            return Admitted(request, admitted.quota)
        if waits.reason is Reason.SHED:
            return Refused(waits, audit=False)
        if reply is not None:
            self._replies[request.request_id] = reply
        return Queued(waits)

    def dequeue(
        self, now: float, route: Callable[[Admitted, Reply | None], Decision]
    ) -> list[Answer]:
        """Queued requests whose turn came, routed now by `route` (given where the answer
        goes, for a request that must wait again: for its LoRA adapter's load), and those
        shed (their wait reached its bound, or the queue was full): each with its answer and
        where it goes. Called whenever room may have freed (an outcome, a load reading, a
        tick)."""
        decided, self._decided = self._decided, []
        out = [Answer(rid, d, self._replies.pop(rid, None)) for rid, d in decided]
        version = self._registry.snapshot.version
        tenants = self._registry.tenants
        for model, q in list(self._queues.items()):
            for late in q.expired(now):
                why = f"no room within {self.settings.max_wait:g} s"
                tenants.waited(late.tenant, now - late.since, True, now)
                out.append(self._answer(late.request_id, self._shed(late.request_id, version, why)))
            while len(q):
                w = q.pop(functools.partial(self._has_room, model, now=now))
                if w is None:
                    break
                tenants.waited(w.tenant, now - w.since, False, now)
                request = self._away_from_full(w.item.request, w.band, now)
                reply = self._replies.pop(w.request_id, None)
                routed = route(Admitted(request, w.item.quota), reply)
                out.append(Answer(w.request_id, routed, reply))
            if not len(q):
                del self._queues[model]
        return out

    def left(self, request_id: str) -> None:
        """A request's end was reported: if it waits, its client left (no answer is wanted)."""
        if self._replies:
            self._replies.pop(request_id, None)
        for q in self._queues.values():
            if q.remove(request_id) is not None:
                return

    @property
    def waiting(self) -> bool:
        """Whether dequeue() may have answers to give (requests queued, or shed unsent)."""
        return bool(self._queues or self._decided)

    def queued_by_band(self) -> dict[str, int]:
        """Requests waiting now, by their class's name (for /metrics)."""
        out = {p.value: 0 for p in Priority}
        names = {p.band: p.value for p in Priority}
        for q in self._queues.values():
            for band, n in q.sizes().items():
                out[names[band]] += n
        return out

    # -- saturation: priority bands ---------------------------------------------------------

    def _answer(self, request_id: str, decision: Decision) -> Answer:
        return Answer(request_id, decision, self._replies.pop(request_id, None))

    def _band(self, request: RouteRequest) -> int:
        tenant = self._registry.tenants.find(request.shape.tenant)
        return (tenant.priority if tenant is not None else Priority.STANDARD).band

    def _full(self, model: str, band: int, now: float) -> tuple[set[BackendId], int]:
        """The model's routable backends that are full for `band`, and how many are
        routable. Full: Baton's requests on it reach the band's share of its capacity, or
        its engine's fresh reading says requests wait in its own queue."""
        reg = self._registry
        cap = self.settings.capacity(band)
        counts = reg.in_flight()
        full, routable = set(), 0
        for s in reg.snapshot.serving(model):
            if not s.routable:
                continue
            routable += 1
            bid = s.backend.id
            load = reg.engine_load(bid)
            queueing = (load is not None and load.waiting > 0
                        and now - load.read_at <= self._stale_after)  # fmt: skip
            if counts.get(bid, 0) >= cap or queueing:
                full.add(bid)
        return full, routable

    def _has_room(self, model: str, band: int, *, now: float) -> bool:
        full, routable = self._full(model, band, now)
        return len(full) < routable

    def _away_from_full(self, request: RouteRequest, band: int, now: float) -> RouteRequest:
        full, _ = self._full(request.shape.model, band, now)
        return replace(request, exclude=request.exclude | full) if full else request

    def _wait_for_room(
        self, request: RouteRequest, admitted: Admission, tokens: int, now: float
    ) -> Decision | None:
        """A QUEUED answer when the request must wait: every routable backend is full for
        its band, or requests of its band or a higher one wait already (they go first); SHED
        when the queue is full of requests no lower than it. None: route it now. No backend
        routable at all: not a wait (route as ever)."""
        model, band = request.shape.model, self._band(request)
        q = self._queues.get(model)
        ahead = q is not None and q.waiting_at_or_above(band)
        full, routable = self._full(model, band, now)
        if not routable or not (ahead or len(full) >= routable):
            return None
        q = self._queues.setdefault(model, Bands())
        version = self._registry.snapshot.version
        tenants = self._registry.tenants
        if len(q) >= self.settings.max_queued:
            victim = q.lowest_newest()
            if victim is None or victim.band <= band:
                tenants.waited(request.shape.tenant, 0.0, True, now)
                return self._shed(request.request_id, version, "the queue is full")
            q.remove(victim.request_id)
            tenants.waited(victim.tenant, now - victim.since, True, now)
            self._decided.append((victim.request_id, self._shed(
                victim.request_id, version, "a higher band's request took its place")))  # fmt: skip
        tenant = tenants.find(request.shape.tenant)
        wait = self.settings.max_wait
        weight = tenant.weight if tenant is not None else 1
        q.push(Waiting(request.request_id, request.shape.tenant, band, weight, max(tokens, 1),
                       now, now + wait, _Queued(request, admitted.quota)))  # fmt: skip
        return Decision((), Reason.QUEUED, version,
                        f"fleet saturated: waiting in band {band}", quota=admitted.quota,
                        wait_s=wait)  # fmt: skip

    def _shed(self, request_id: str, version: int, why: str) -> Decision:
        self._registry.tenants.cancel(request_id)
        return Decision((), Reason.SHED, version, f"fleet saturated: {why}",
                        wait_s=self.settings.max_wait)  # fmt: skip
