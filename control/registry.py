"""The single owner of fleet state. Every mutation goes through here and publishes a new,
immutable, versioned Snapshot to subscribers; readers never see half-applied state."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from baton.model import (
    Backend,
    BackendId,
    BackendStatus,
    Pairing,
    PairState,
    RequestShape,
    Role,
    Snapshot,
    Verdict,
)
from control import health
from control.affinity import PinTable
from control.events import EventKind, EventLog
from control.facts import Facts, pair_violations
from control.health import HealthPolicy, HealthRecord
from control.load import Load
from control.pairs import DEFAULT_DRAFT_TOKENS, Pair, PairTable, gate


class RegistryError(Exception):
    """Base of the registry's refusals; services/errors.py maps each to a gRPC status."""


class BackendExists(RegistryError):
    pass


class BackendNotFound(RegistryError):
    pass


class PairRefused(RegistryError):
    """A pairing breaks an invariant; the message starts with the invariant's name."""


class PairNotFound(RegistryError):
    pass


class PairExists(RegistryError):
    pass


@dataclass(frozen=True, slots=True)
class GateResult:
    verdict: Verdict
    reason: str
    pair: Pair
    baseline: float | None
    observed: float
    # On reject: the target the draft was re-bound to; None when none matches (detached).
    target: Backend | None = None


Clock = Callable[[], float]
Listener = Callable[[Snapshot], None]


class Registry:
    def __init__(
        self,
        backends: Iterable[Backend] = (),
        *,
        clock: Clock,
        health_policy: HealthPolicy | None = None,
        events: EventLog | None = None,
        pins: PinTable | None = None,
        drained: Mapping[str, bool] | None = None,
    ) -> None:
        """`drained`: backends drained before a restart (id -> migrate), restored as they
        were, with no new audit event: nobody drained them just now."""
        self._clock = clock
        self.events = events if events is not None else EventLog(clock)
        self._policy = health_policy or HealthPolicy()
        self._backends: dict[BackendId, Backend] = {}
        self._health: dict[BackendId, HealthRecord] = {}
        self._listeners: list[Listener] = []
        self.load = Load()
        self.pins = pins if pins is not None else PinTable()
        self.pairs = PairTable()
        # Facts read from each backend (GET /server_info); absent until read.
        self.facts: dict[BackendId, Facts] = {}
        now = clock()
        for b in backends:
            if b.id in self._backends:
                raise BackendExists(f"backend {b.id!r} is listed twice")
            self._backends[b.id] = b
            self._health[b.id] = HealthRecord.new(now)
        # Drained with --migrate; the health state is DRAINING either way.
        self._migrating: set[BackendId] = set()
        for bid, migrate in (drained or {}).items():
            if bid in self._backends:
                known = BackendId(bid)
                self._health[known] = health.drain(self._health[known], now)
                if migrate:
                    self._migrating.add(known)
        self._snapshot = Snapshot(0, ())
        self._publish()

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def in_flight(self) -> Mapping[BackendId, int]:
        return self.load.counts()

    def backend(self, backend_id: str) -> Backend:
        return self._backends[self._known(backend_id)]

    @property
    def backends(self) -> tuple[Backend, ...]:
        return tuple(self._backends[bid] for bid in sorted(self._backends))

    def drained(self) -> dict[BackendId, bool]:
        """Backends an operator drained (id -> migrate): configuration, kept across restarts."""
        return {
            bid: bid in self._migrating for bid in sorted(self._health) if self._health[bid].drained
        }

    # -- configuration -------------------------------------------------------------------

    def add(self, backend: Backend) -> BackendStatus:
        if backend.id in self._backends:
            raise BackendExists(f"backend {backend.id!r} already exists")
        self._backends[backend.id] = backend
        self._health[backend.id] = HealthRecord.new(self._clock())
        self._publish()
        self.events.record(
            EventKind.ADMIN,
            backend_id=backend.id,
            action="add",
            url=backend.url,
            model=backend.model,
            kind_of_backend=backend.kind.value,
            role=backend.role.value,
        )
        return self._status(backend.id)

    def remove(self, backend_id: str) -> None:
        bid = self._known(backend_id)
        del self._backends[bid]
        del self._health[bid]
        self._migrating.discard(bid)
        self.facts.pop(bid, None)
        for pair in self.pairs.with_backend(bid):
            if pair.draft_id == bid:
                self.pairs.remove(pair.id)
                self._pair_event(pair, "unbind", reason=f"draft {bid} removed")
        # Its pins stay until used (then re-pinned, visibly, as `repin`) or expired.
        self._publish()
        self.events.record(EventKind.ADMIN, backend_id=bid, action="remove")

    def drain(self, backend_id: str, migrate: bool = False) -> BackendStatus:
        """No new requests to the backend; with `migrate`, shims also move its in-flight
        streams elsewhere (the resume protocol). Draining again changes only `migrate`."""
        bid = self._known(backend_id)
        status = self._drain_step(bid, migrate, lambda rec, now: health.drain(rec, now))
        self.events.record(EventKind.ADMIN, backend_id=bid, action="drain", migrate=migrate)
        return status

    def undrain(self, backend_id: str) -> BackendStatus:
        bid = self._known(backend_id)
        status = self._drain_step(bid, False, lambda rec, now: health.undrain(rec, now))
        self.events.record(EventKind.ADMIN, backend_id=bid, action="undrain")
        return status

    def _drain_step(
        self, bid: BackendId, migrate: bool, step: Callable[[HealthRecord, float], HealthRecord]
    ) -> BackendStatus:
        flipped = (bid in self._migrating) != migrate
        if migrate:
            self._migrating.add(bid)
        else:
            self._migrating.discard(bid)
        version = self._snapshot.version
        status = self._update(bid, step)
        # Shims learn of a migration from the snapshot, even when the state stays DRAINING.
        if flipped and self._snapshot.version == version:
            self._publish()
        return status

    # -- health --------------------------------------------------------------------------

    def report_failure(self, backend_id: str, reason: str) -> BackendStatus | None:
        """A shim saw a real failure. Unknown ids are ignored: the backend may just have
        been removed while the request was in flight."""
        if backend_id not in self._backends:
            return None
        return self._update(backend_id, lambda rec, now: health.passive_failure(rec, reason, now))

    def probe_result(self, backend_id: str, ok: bool, reason: str = "") -> BackendStatus | None:
        if backend_id not in self._backends:
            return None
        if ok:
            return self._update(
                backend_id, lambda rec, now: health.probe_ok(rec, now, self._policy)
            )
        return self._update(
            backend_id, lambda rec, now: health.probe_failed(rec, reason, now, self._policy)
        )

    # -- speculative pairs ---------------------------------------------------------------
    def set_facts(self, backend_id: str, facts: Facts) -> None:
        if backend_id in self._backends:
            self.facts[BackendId(backend_id)] = facts

    def bind_pair(
        self, draft_id: str, target_id: str, num_draft_tokens: int, draft: Facts, target: Facts
    ) -> Pair:
        """`draft` and `target` are facts the caller just read from the two backends."""
        d, t = self._backends[self._known(draft_id)], self._backends[self._known(target_id)]
        if d.role is not Role.DRAFT:
            raise PairRefused(f"role: backend {d.id!r} is not a draft (role {d.role.value})")
        if not t.serves_clients:
            raise PairRefused(f"role: backend {t.id!r} is a draft, not a target")
        if draft_id == target_id:
            raise PairRefused("role: a backend cannot be its own draft")
        if self.pairs.get(d.id) is not None:
            raise PairExists(f"draft {d.id!r} is already bound; unbind it first")
        violations = pair_violations(draft, target)
        if violations:
            raise PairRefused("; ".join(f"{v.invariant}: {v.detail}" for v in violations))
        self.facts[d.id], self.facts[t.id] = draft, target
        pair = self.pairs.put(
            Pair(d.id, t.model, d.id, t.id, t.id, num_draft_tokens or DEFAULT_DRAFT_TOKENS,
                 draft.params_hash)
        )  # fmt: skip
        self._pair_event(pair, "bind", reason="facts verified")
        return pair

    def unbind_pair(self, pair_id: str) -> None:
        pair = self.pairs.remove(pair_id)
        if pair is None:
            raise PairNotFound(f"no pair with id {pair_id!r}")
        self._pair_event(pair, "unbind")

    def pairing_for(self, primary: Backend, shape: RequestShape) -> Pairing | None:
        """The pair this request may use on `primary`, if any. When a pair's target is gone,
        the primary takes its place (if its facts match the draft's), pending the gate."""
        if not shape.spec_eligible:
            return None
        pair = self.pairs.for_target(primary.id)
        if pair is None:
            pair = self._adopt(primary)
            if pair is None:
                return None
        draft = self._backends.get(pair.draft_id)
        facts = self.facts.get(pair.draft_id)
        if draft is None or facts is None or not self._routable(pair.draft_id):
            return None
        target = self.facts.get(pair.target_id)
        if target is not None and (broken := pair_violations(facts, target)):
            # The target was re-read since (it came back with another config): never serve
            # through it; move the draft to a target that still matches.
            why = "; ".join(f"{v.invariant}: {v.detail}" for v in broken)
            self._pair_event(pair, "reject", reason=why)
            self._rebind(pair, exclude=pair.target_id, why=why)
            return None
        greedy = shape.greedy if shape.sets_temperature else facts.sampling.temperature == 0
        if not greedy:
            return None
        return Pairing(pair.id, draft, pair.num_draft_tokens, pair.params_hash,
                       pair.gate_pending, facts.eos_token_id)  # fmt: skip

    def repair(self, pair_id: str, new_target_id: str, failed_id: str) -> Pairing | None:
        """A failover moved a spec request off its pair's target: the draft is paired with the
        new backend, pending the gate (the shim probes it before emitting anything)."""
        pair = self.pairs.get(pair_id)
        target = self._backends.get(BackendId(new_target_id))
        draft = self._backends.get(pair.draft_id) if pair else None
        if pair is None or target is None or draft is None or target.role is Role.DRAFT:
            return None
        if pair.target_id != target.id:
            pair = self.pairs.retarget(pair, target.id, f"failover from {failed_id}")
            self._pair_event(pair, "repair", previous=failed_id)
        eos = f.eos_token_id if (f := self.facts.get(pair.draft_id)) else None
        return Pairing(pair.id, draft, pair.num_draft_tokens, pair.params_hash, True, eos)

    def gate_pairing(
        self, pair_id: str, target_id: str, drafted: int, accepted: int, target: Facts | None
    ) -> GateResult:
        """Judge a probe round of `pair_id` on `target_id`; `target` are the facts just read
        from it (None: it didn't answer, which fails closed like a params mismatch)."""
        pair = self.pairs.get(pair_id)
        if pair is None:
            raise PairNotFound(f"no pair with id {pair_id!r}")
        observed = accepted / drafted if drafted else 0.0
        baseline = self.pairs.baseline(pair)
        if pair.target_id != target_id or not pair.gate_pending:
            # Another request's probe was judged first: answer with where the pair stands.
            return self._standing(pair, target_id, baseline, observed)
        if target is not None:
            self.facts[BackendId(target_id)] = target
        same = target is not None and target.params_hash == pair.params_hash
        verdict, reason = gate(baseline, observed, same)
        if target is None:
            reason = "facts unavailable from the new target (fail closed)"
        if verdict is not Verdict.REJECT:
            pair = self.pairs.judged(pair, verdict, reason, observed)
            self._pair_event(pair, verdict.value, reason=reason, observed=observed,
                             baseline=baseline)  # fmt: skip
            return GateResult(verdict, reason, pair, baseline, observed)
        self._pair_event(pair, "reject", reason=reason, observed=observed, baseline=baseline)
        pair, rebound = self._rebind(pair, exclude=BackendId(target_id), why=reason)
        return GateResult(verdict, reason, pair, baseline, observed, rebound)

    def spec_outcome(
        self, pair_id: str, target_id: str, rounds: int, drafted: int, accepted: int,
        quality_ok: bool = True, quality: str = "",
    ) -> None:  # fmt: skip
        pair = self.pairs.get(pair_id)
        if pair is None or pair.target_id != target_id:
            return  # the pair moved on since; this acceptance belongs to an old pairing
        pair = self.pairs.observe(pair, rounds, drafted, accepted)
        if not quality_ok and pair.state is not PairState.DETACHED:
            reason = f"quality signal: {quality}"
            self._pair_event(pair, "reject", reason=reason)
            self._rebind(pair, exclude=pair.target_id, why=reason)
        elif pair.state is PairState.ACTIVE and pair.reason == "probation passed":
            pair = self.pairs.judged(pair, Verdict.ACCEPT, "active", pair.recent or 0.0)
            self._pair_event(pair, "active", reason="probation passed")

    def _standing(
        self, pair: Pair, target_id: str, baseline: float | None, observed: float
    ) -> GateResult:
        if pair.target_id == target_id and pair.state is not PairState.DETACHED:
            verdict = Verdict.ACCEPT if pair.state is PairState.ACTIVE else Verdict.PROBATION
            return GateResult(verdict, pair.reason, pair, baseline, observed)
        rebound = None if pair.state is PairState.DETACHED else self._backends.get(pair.target_id)
        return GateResult(Verdict.REJECT, pair.reason, pair, baseline, observed, rebound)

    def _rebind(self, pair: Pair, exclude: BackendId, why: str) -> tuple[Pair, Backend | None]:
        """Re-bind the draft to a routable target of the model whose facts match its own
        (the least loaded), or detach it when there is none."""
        draft = self.facts.get(pair.draft_id)
        load = self.load.counts()
        candidates = [
            s.backend
            for s in self._snapshot.serving(pair.model)
            if s.routable
            and s.backend.id != exclude
            and draft is not None
            and (f := self.facts.get(s.backend.id)) is not None
            and not pair_violations(draft, f)
        ]
        if not candidates:
            pair = self.pairs.detach(pair, f"no healthy target matches the draft ({why})")
            self._pair_event(pair, "detach", reason=pair.reason)
            return pair, None
        target = min(candidates, key=lambda b: (load.get(b.id, 0), b.id))
        # Its facts were checked just now: it serves at once, on probation, not re-probed.
        pair = self.pairs.judged(
            self.pairs.retarget(pair, target.id, why), Verdict.PROBATION, f"re-bound ({why})",
            0.0,
        )
        self._pair_event(pair, "rebind", reason=why)
        return pair, target

    def _adopt(self, primary: Backend) -> Pair | None:
        """A pair of this model whose target can't serve takes the primary as its target,
        if the primary's known facts match the draft's."""
        f = self.facts.get(primary.id)
        for pair in self.pairs.for_model(primary.model):
            if self._routable(pair.target_id) and pair.state is not PairState.DETACHED:
                continue
            draft = self.facts.get(pair.draft_id)
            if f is None or draft is None or pair_violations(draft, f):
                continue
            previous = pair.target_id
            pair = self.pairs.retarget(pair, primary.id, f"target {previous} unavailable")
            self._pair_event(pair, "repair", previous=previous)
            return pair
        return None

    def _routable(self, backend_id: str) -> bool:
        s = self._snapshot.get(backend_id)
        return s is not None and s.routable

    def _pair_event(self, pair: Pair, action: str, **data: Any) -> None:
        self.events.record(
            EventKind.PAIR,
            backend_id=pair.target_id,
            pair=pair.id,
            action=action,
            draft=pair.draft_id,
            target=pair.target_id,
            state=pair.state.value,
            params_hash=pair.params_hash,
            **{k: v for k, v in data.items() if v is not None},
        )

    # -- internals -----------------------------------------------------------------------

    def _known(self, backend_id: str) -> BackendId:
        bid = BackendId(backend_id)
        if bid not in self._backends:
            raise BackendNotFound(f"no backend with id {backend_id!r}")
        return bid

    def _status(self, bid: BackendId) -> BackendStatus:
        return BackendStatus(self._backends[bid], self._health[bid].health, bid in self._migrating)

    def _update(
        self, backend_id: str, step: Callable[[HealthRecord, float], HealthRecord]
    ) -> BackendStatus:
        bid = self._known(backend_id)
        before = self._health[bid]
        after = step(before, self._clock())
        self._health[bid] = after
        # Streak counters change on every probe; only a visible change is a new snapshot.
        if after.health != before.health:
            self._publish()
            if after.health.state is not before.health.state:
                self.events.record(
                    EventKind.HEALTH,
                    backend_id=bid,
                    state=after.health.state.value,
                    previous=before.health.state.value,
                    reason=after.health.reason,
                )
        return self._status(bid)

    def _publish(self) -> None:
        statuses = tuple(self._status(bid) for bid in sorted(self._backends))
        self._snapshot = Snapshot(self._snapshot.version + 1, statuses)
        for listener in list(self._listeners):
            listener(self._snapshot)
