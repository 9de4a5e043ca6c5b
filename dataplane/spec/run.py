"""One speculative request's state across rounds and failovers, and what control hears of
it: the failover event of a target that died, and the request's outcome."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from baton.model import (
    Backend,
    FailoverOutcome,
    FailoverReport,
    Failure,
    Pairing,
    RequestOutcome,
    RequestShape,
    ResumePath,
    Seam,
    SpecStats,
)
from dataplane.outcomes import outcome
from dataplane.request import ClientRequest, Endpoint
from dataplane.spec.plan import repeated_ngram
from dataplane.spec.rounds import Ahead


@dataclass(slots=True)
class SpecRun:
    """One request's state across rounds and failovers."""

    request_id: str
    client: ClientRequest
    shape: RequestShape
    target: Backend
    pairing: Pairing | None
    ctx: list[int] = field(default_factory=list)  # prompt ids + everything emitted
    prompt_len: int = 0
    generated: list[int] = field(default_factory=list)
    text: str = ""  # detokenised `generated`, as far as sent
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tried: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    moving: Move | None = None  # a failover whose first resumed byte has not been sent yet
    k: int = 0  # the next round's draft length (plan.next_k); 0: the pairing's own
    ahead: Ahead | None = None  # the next round's proposal, drafted while this one verifies

    def drop_ahead(self) -> None:
        """The proposal in flight will not be taken (a failure, a new pairing, the end)."""
        if self.ahead is not None:
            self.ahead.cancel()
            self.ahead = None


@dataclass(frozen=True, slots=True)
class Move:
    """A target that failed mid-stream, until the failover's outcome is known."""

    from_backend: str
    failure: Failure
    detected: float  # monotonic
    tokens_sent: int
    attempt: int


def failover_report(
    run: SpecRun, move: Move, outcome: FailoverOutcome, detail: str = ""
) -> FailoverReport:
    """The audit event of a pending failover: `resumed` once the new target's text reached
    the client, `failed` when it failed too, `exhausted` when the request ends in an error.
    The resume is by ids from the exact context, so there is no overlap to check."""
    resumed = outcome is FailoverOutcome.RESUMED
    return FailoverReport(
        request_id=run.request_id,
        from_backend=move.from_backend,
        to_backend=run.target.id if outcome is not FailoverOutcome.EXHAUSTED else "",
        failure=move.failure,
        choice=0,
        tokens_sent=move.tokens_sent,
        path=ResumePath.TOKEN,
        seam=Seam.UNCHECKED if resumed else None,
        gap_ms=(time.monotonic() - move.detected) * 1000 if resumed else 0.0,
        attempt=move.attempt,
        outcome=outcome,
        detail=detail or "speculative pair's target",
    )


def request_outcome(run: SpecRun, ok: bool) -> RequestOutcome:
    """What control hears when the request ends: its target, timing and the pair's stats."""
    chat = run.client.endpoint is Endpoint.CHAT
    stats = None
    if run.pairing is not None or run.rounds:
        pair_id = run.pairing.pair_id if run.pairing else ""
        stats = SpecStats(pair_id, run.target.id, run.rounds, run.drafted, run.accepted,
                          repeated_ngram(run.generated))  # fmt: skip
    return outcome(
        run.request_id, run.target.id, run.client.model, 200 if ok else 502,
        shape=run.shape, started=run.started, first_byte=run.first_byte, now=time.monotonic(),
        reply=run.text if ok and chat else None, completion_tokens=len(run.generated),
        spec=stats if stats is not None and stats.pair_id else None,
    )  # fmt: skip
