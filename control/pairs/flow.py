"""Speculative pairs over the fleet: binding a draft to a target, which pairing a request may
use, re-pairing after a failover, and the gate's verdicts on the result
(docs/architecture.md#speculative-pairs-and-the-gate).

The flow owns the one PairTable (control/pairs/table.py holds the pure rules); the fleet itself,
backends, health and facts, stays the registry's, asked through its narrow methods. Every
change to a pair is a `pair` audit event, recorded here as it happens."""

# baton: pure

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from baton.model import Backend, BackendId, Pairing, PairState, RequestShape, Role, Verdict
from control.audit.payloads import PairChange
from control.exceptions import PairExists, PairNotFound, PairRefused
from control.fleet.registry import Registry
from control.pairs.table import DEFAULT_DRAFT_TOKENS, Pair, PairTable, gate, retargeted
from control.signals.facts import Facts, describe, pair_violations


@dataclass(frozen=True, slots=True)
class GateResult:
    verdict: Verdict
    reason: str
    pair: Pair
    baseline: float | None
    observed: float
    # On reject: the target the draft was re-bound to; None when none matches (detached).
    target: Backend | None = None


@dataclass(frozen=True, slots=True)
class Adopted:
    """`pair` retargeted to the request's primary, its target `previous` being unavailable."""

    pair: Pair
    previous: BackendId


@dataclass(frozen=True, slots=True)
class Rejected:
    """`pair`'s target no longer matches its draft (`why`): the draft is to be re-bound."""

    pair: Pair
    why: str


@dataclass(frozen=True, slots=True)
class PairIntent:
    """What routing a request to a primary means for the pairs (PairFlow.pairing_for): the
    pairing the request may use, and the change to the pairs it implies, which the router's
    commit applies (PairFlow.apply) before anything else it writes."""

    pairing: Pairing | None = None
    adopt: Adopted | None = None
    reject: Rejected | None = None


NO_PAIRING = PairIntent()


class PairFlow:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._events = registry.events
        self._pairs = PairTable()
        # A removed draft takes its pair with it, in the same step as the removal.
        registry.on_remove(self._backend_removed)

    # -- reads (admin, metrics, persistence) ----------------------------------------------

    def __iter__(self) -> Iterator[Pair]:
        return iter(self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def get(self, pair_id: str) -> Pair | None:
        return self._pairs.get(pair_id)

    def baseline(self, pair: Pair) -> float | None:
        return self._pairs.baseline(pair)

    # -- operators -------------------------------------------------------------------------

    def bind_pair(
        self, draft_id: str, target_id: str, num_draft_tokens: int, draft: Facts, target: Facts
    ) -> Pair:
        """`draft` and `target` are facts the caller just read from the two backends."""
        reg = self._registry
        d, t = reg.backend(draft_id), reg.backend(target_id)
        if d.role is not Role.DRAFT:
            raise PairRefused(f"role: backend {d.id!r} is not a draft (role {d.role.value})")
        if not t.serves_clients:
            raise PairRefused(f"role: backend {t.id!r} is a draft, not a target")
        if draft_id == target_id:
            raise PairRefused("role: a backend cannot be its own draft")
        if self._pairs.get(d.id) is not None:
            raise PairExists(f"draft {d.id!r} is already bound; unbind it first")
        violations = pair_violations(draft, target)
        if violations:
            raise PairRefused(describe(violations))
        reg.set_facts(d.id, draft)
        reg.set_facts(t.id, target)
        pair = self._pairs.put(
            Pair(d.id, t.model, d.id, t.id, t.id, num_draft_tokens or DEFAULT_DRAFT_TOKENS,
                 draft.params_hash)
        )  # fmt: skip
        self._pair_event(pair, "bind", reason="facts verified")
        return pair

    def unbind_pair(self, pair_id: str) -> None:
        pair = self._pairs.remove(pair_id)
        if pair is None:
            raise PairNotFound(f"no pair with id {pair_id!r}")
        self._pair_event(pair, "unbind")

    def _backend_removed(self, bid: BackendId) -> None:
        for pair in self._pairs.with_backend(bid):
            if pair.draft_id == bid:
                self._pairs.remove(pair.id)
                self._pair_event(pair, "unbind", reason=f"draft {bid} removed")

    # -- the routing path ------------------------------------------------------------------

    def pairing_for(self, primary: Backend, shape: RequestShape) -> PairIntent:
        """The pair this request may use on `primary`, if any, decided without writing: the
        change it implies, for the router's commit to `apply`. When a pair's target is gone,
        the primary takes its place (if its facts match the draft's), pending the gate; when
        the target's facts changed, the pair is rejected and its draft re-bound."""
        if not shape.spec_eligible:
            return NO_PAIRING
        reg = self._registry
        adopted = None
        pair = self._pairs.for_target(primary.id)
        if pair is None:
            adopted = self._adoptable(primary)
            if adopted is None:
                return NO_PAIRING
            pair = adopted.pair
        draft = reg.find(pair.draft_id)
        facts = reg.facts.get(pair.draft_id)
        if draft is None or facts is None or not reg.routable(pair.draft_id):
            return PairIntent(adopt=adopted)
        target = reg.facts.get(pair.target_id)
        if target is None:
            # it came back and could not say: fail closed, target alone
            return PairIntent(adopt=adopted)
        if broken := pair_violations(facts, target):
            # The target was re-read since (it came back with another config): never serve
            # through it; move the draft to a target that still matches.
            return PairIntent(adopt=adopted, reject=Rejected(pair, describe(broken)))
        # The router sets every sampling parameter on the pair's calls (baton/sampling.py):
        # a request that leaves its temperature to the engine's generation config asks for
        # something the pair cannot know, so the target alone serves it.
        if not (shape.sets_temperature and shape.greedy):
            return PairIntent(adopt=adopted)
        pairing = Pairing(pair.id, draft, pair.num_draft_tokens, pair.params_hash,
                          pair.gate_pending)  # fmt: skip
        return PairIntent(pairing, adopt=adopted)

    def apply(self, intent: PairIntent) -> None:
        """The change `pairing_for` decided, made (and recorded as pair events)."""
        if (adopted := intent.adopt) is not None:
            pair = self._pairs.put(adopted.pair)
            self._pair_event(pair, "repair", previous=adopted.previous)
        if (rejected := intent.reject) is not None:
            self._pair_event(rejected.pair, "reject", reason=rejected.why)
            self._rebind(rejected.pair, exclude=rejected.pair.target_id, why=rejected.why)

    def repair(self, pair_id: str, new_target_id: str, failed_id: str) -> Pairing | None:
        """A failover moved a spec request off its pair's target: the draft is paired with the
        new backend, pending the gate (the shim probes it before emitting anything)."""
        reg = self._registry
        pair = self._pairs.get(pair_id)
        target = reg.find(new_target_id)
        draft = reg.find(pair.draft_id) if pair else None
        if pair is None or target is None or draft is None or target.role is Role.DRAFT:
            return None
        if pair.target_id != target.id:
            pair = self._pairs.retarget(pair, target.id, f"failover from {failed_id}")
            self._pair_event(pair, "repair", previous=failed_id)
        return Pairing(pair.id, draft, pair.num_draft_tokens, pair.params_hash, True)

    def gate_pairing(
        self, pair_id: str, target_id: str, drafted: int, accepted: int, target: Facts | None
    ) -> GateResult:
        """Judge a probe round of `pair_id` on `target_id`; `target` are the facts just read
        from it (None: it didn't answer, which fails closed like a params mismatch)."""
        pair = self._pairs.get(pair_id)
        if pair is None:
            raise PairNotFound(f"no pair with id {pair_id!r}")
        observed = accepted / drafted if drafted else 0.0
        baseline = self._pairs.baseline(pair)
        if pair.target_id != target_id or not pair.gate_pending:
            # Another request's probe was judged first: answer with where the pair stands.
            return self._standing(pair, target_id, baseline, observed)
        if target is not None:
            self._registry.set_facts(target_id, target, known_only=False)
        draft = self._registry.facts.get(pair.draft_id)
        broken = pair_violations(draft, target) if draft and target else []
        same = target is not None and target.params_hash == pair.params_hash
        verdict, reason = gate(baseline, observed, same)
        if target is None or draft is None:
            verdict, reason = Verdict.REJECT, "facts unavailable (fail closed)"
        elif broken:
            # Whatever its acceptance, the new target's ids do not mean what the draft's do
            # (or its engine cannot run a round): fail closed.
            verdict, reason = Verdict.REJECT, f"{describe(broken)} (acceptance {observed:.2f})"
        if verdict is not Verdict.REJECT:
            pair = self._pairs.judged(pair, verdict, reason, observed)
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
        pair = self._pairs.get(pair_id)
        if pair is None or pair.target_id != target_id:
            return  # the pair moved on since; this acceptance belongs to an old pairing
        pair = self._pairs.observe(pair, rounds, drafted, accepted)
        if not quality_ok and pair.state is not PairState.DETACHED:
            reason = f"quality signal: {quality}"
            self._pair_event(pair, "reject", reason=reason)
            self._rebind(pair, exclude=pair.target_id, why=reason)
        elif pair.state is PairState.ACTIVE and pair.reason == "probation passed":
            pair = self._pairs.judged(pair, Verdict.ACCEPT, "active", pair.recent or 0.0)
            self._pair_event(pair, "active", reason="probation passed")

    # -- helpers ---------------------------------------------------------------------------

    def _standing(
        self, pair: Pair, target_id: str, baseline: float | None, observed: float
    ) -> GateResult:
        if pair.target_id == target_id and pair.state is not PairState.DETACHED:
            verdict = Verdict.ACCEPT if pair.state is PairState.ACTIVE else Verdict.PROBATION
            return GateResult(verdict, pair.reason, pair, baseline, observed)
        rebound = None if pair.state is PairState.DETACHED else self._registry.find(pair.target_id)
        return GateResult(Verdict.REJECT, pair.reason, pair, baseline, observed, rebound)

    def _rebind(self, pair: Pair, exclude: BackendId, why: str) -> tuple[Pair, Backend | None]:
        """Re-bind the draft to a routable target of the model whose facts match its own
        (the least loaded), or detach it when there is none."""
        reg = self._registry
        draft = reg.facts.get(pair.draft_id)
        load = reg.in_flight()
        candidates = [
            s.backend
            for s in reg.snapshot.serving(pair.model)
            if s.routable
            and s.backend.id != exclude
            and draft is not None
            and (f := reg.facts.get(s.backend.id)) is not None
            and not pair_violations(draft, f)
        ]
        if not candidates:
            pair = self._pairs.detach(pair, f"no healthy target matches the draft ({why})")
            self._pair_event(pair, "detach", reason=pair.reason)
            return pair, None
        target = min(candidates, key=lambda b: (load.get(b.id, 0), b.id))
        # Its facts were checked just now: it serves at once, on probation, not re-probed.
        pair = self._pairs.judged(
            self._pairs.retarget(pair, target.id, why),
            Verdict.PROBATION,
            f"re-bound ({why})",
            0.0,
        )
        self._pair_event(pair, "rebind", reason=why)
        return pair, target

    def _adoptable(self, primary: Backend) -> Adopted | None:
        """A pair of this model whose target can't serve, with the primary as its target, if
        the primary's known facts match the draft's (not yet in the table)."""
        reg = self._registry
        f = reg.facts.get(primary.id)
        for pair in self._pairs.for_model(primary.model):
            if reg.routable(pair.target_id) and pair.state is not PairState.DETACHED:
                continue
            draft = reg.facts.get(pair.draft_id)
            if f is None or draft is None or pair_violations(draft, f):
                continue
            previous = pair.target_id
            return Adopted(retargeted(pair, primary.id, f"target {previous} unavailable"),
                           previous)  # fmt: skip
        return None

    def _pair_event(
        self,
        pair: Pair,
        action: str,
        *,
        reason: str | None = None,
        previous: str | None = None,
        observed: float | None = None,
        baseline: float | None = None,
    ) -> None:
        self._events.record(
            PairChange(
                pair=pair.id, action=action, draft=pair.draft_id, target=pair.target_id,
                state=pair.state, params_hash=pair.params_hash, reason=reason,
                previous=previous, observed=observed, baseline=baseline,
            ),
            backend_id=pair.target_id,
        )  # fmt: skip
