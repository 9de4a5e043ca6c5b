"""Speculative pairs: their state, the paired acceptance baseline and the post-failover gate.

Pure: the registry owns the one PairTable and calls it; I/O (fetching facts, events) is the
caller's. The gate answers the incident in docs/architecture.md#speculative-pairs-and-the-gate:
after a failover re-pairs a draft, its acceptance is compared with the *paired* baseline (same
draft, same params hash), and a pairing whose target samples with other params never serves, however
good it looks.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from baton.model import BackendId, PairState, Verdict

DEFAULT_DRAFT_TOKENS = 4
JUMP = 0.25  # acceptance above the paired baseline by more than this is a spike
EWMA_ALPHA = 0.2
PROBATION_ROUNDS = 64  # rounds in line with the baseline before a probation pairing is active


@dataclass(frozen=True, slots=True)
class Pair:
    id: str
    model: str
    draft_id: BackendId
    target_id: BackendId  # in use now
    bound_target_id: BackendId  # as the operator bound it
    num_draft_tokens: int
    params_hash: str  # the draft's
    state: PairState = PairState.ACTIVE
    reason: str = "bound"
    # The pairing changed and no probe round has been judged yet: the next request to use it
    # runs one and asks the gate before emitting.
    gate_pending: bool = False
    recent: float | None = None  # acceptance on the current pairing
    rounds: int = 0  # on the current pairing
    probation_rounds: int = 0


def retargeted(pair: Pair, target_id: BackendId, reason: str) -> Pair:
    """`pair` with a new target for its draft, pending the gate (not yet in any table)."""
    return replace(pair, target_id=target_id, state=PairState.PROBATION, reason=reason,
                   gate_pending=True, recent=None, rounds=0, probation_rounds=0)  # fmt: skip


def ewma(old: float | None, x: float) -> float:
    return x if old is None else old + EWMA_ALPHA * (x - old)


def gate(
    baseline: float | None, observed: float, same_params: bool, quality_ok: bool = True
) -> tuple[Verdict, str]:
    """The verdict on a new pairing's probe round (or on a quality signal)."""
    base = "none" if baseline is None else f"{baseline:.2f}"
    seen = f"acceptance {observed:.2f} vs paired baseline {base}"
    if not same_params:
        # Fail closed even without a spike: with other sampling params the target's logits
        # don't verify what the draft's params would have produced.
        return Verdict.REJECT, f"params_hash differs ({seen})"
    if not quality_ok:
        return Verdict.REJECT, f"quality signal ({seen})"
    if baseline is not None and observed - baseline > JUMP:
        return Verdict.PROBATION, f"acceptance jumped ({seen})"
    return Verdict.ACCEPT, seen


class PairTable:
    """Pairs by id and the paired baselines by (draft, params hash)."""

    def __init__(self) -> None:
        self._pairs: dict[str, Pair] = {}
        self._baseline: dict[tuple[BackendId, str], float] = {}

    def __iter__(self) -> Iterator[Pair]:
        return iter(sorted(self._pairs.values(), key=lambda p: p.id))

    def __len__(self) -> int:
        return len(self._pairs)

    def get(self, pair_id: str) -> Pair | None:
        return self._pairs.get(pair_id)

    def put(self, pair: Pair) -> Pair:
        self._pairs[pair.id] = pair
        return pair

    def remove(self, pair_id: str) -> Pair | None:
        return self._pairs.pop(pair_id, None)

    def baseline(self, pair: Pair) -> float | None:
        return self._baseline.get((pair.draft_id, pair.params_hash))

    def for_target(self, target_id: str) -> Pair | None:
        for p in self._pairs.values():
            if p.target_id == target_id and p.state is not PairState.DETACHED:
                return p
        return None

    def for_model(self, model: str) -> list[Pair]:
        return [p for p in self._pairs.values() if p.model == model]

    def with_backend(self, backend_id: str) -> list[Pair]:
        return [
            p
            for p in self._pairs.values()
            if backend_id in (p.draft_id, p.target_id, p.bound_target_id)
        ]

    def retarget(self, pair: Pair, target_id: BackendId, reason: str) -> Pair:
        """A new target for the draft: judged by the gate on the next probe round."""
        return self.put(retargeted(pair, target_id, reason))

    def judged(self, pair: Pair, verdict: Verdict, reason: str, observed: float) -> Pair:
        state = PairState.ACTIVE if verdict is Verdict.ACCEPT else PairState.PROBATION
        return self.put(replace(pair, state=state, reason=reason, gate_pending=False,
                                recent=observed))  # fmt: skip

    def detach(self, pair: Pair, reason: str) -> Pair:
        return self.put(replace(pair, state=PairState.DETACHED, reason=reason,
                                gate_pending=False))  # fmt: skip

    def observe(self, pair: Pair, rounds: int, drafted: int, accepted: int) -> Pair:
        """Acceptance from a finished request on the pair's current target. Only an active
        pairing moves the baseline; a probation one graduates after enough rounds in line
        with it (a spike alone never locks a pairing in)."""
        if drafted <= 0:
            return pair
        x = accepted / drafted
        recent = ewma(pair.recent, x)
        key = (pair.draft_id, pair.params_hash)
        if pair.state is PairState.ACTIVE:
            self._baseline[key] = ewma(self._baseline.get(key), x)
            return self.put(replace(pair, recent=recent, rounds=pair.rounds + rounds))
        if pair.state is PairState.PROBATION:
            base = self._baseline.get(key)
            in_line = base is None or abs(recent - base) <= JUMP
            served = pair.probation_rounds + rounds if in_line else 0
            if served >= PROBATION_ROUNDS:
                return self.put(replace(pair, state=PairState.ACTIVE, recent=recent,
                                        rounds=pair.rounds + rounds, probation_rounds=0,
                                        reason="probation passed"))  # fmt: skip
            return self.put(replace(pair, recent=recent, rounds=pair.rounds + rounds,
                                    probation_rounds=served))  # fmt: skip
        return pair
