"""What control learns from the shims' reports. A failed attempt demotes its backend at once
(before the next probe); a request's outcome releases its load, settles its tenant's usage,
teaches the prefill rates (its TTFT) and the chain's KV blocks, tells the pair its acceptance,
and pins the reply where it was generated, so the next turn finds it."""

# baton: pure

from __future__ import annotations

from collections.abc import Iterable

from baton.budgets import Standing
from baton.model import BackendId, Failure, RequestOutcome
from baton.pricing import money
from control.audit.payloads import BudgetReached, Retry
from control.fleet.registry import Registry
from control.pairs.flow import PairFlow
from control.routing.prefill import PrefillRates


class Learning:
    def __init__(self, registry: Registry, pairs: PairFlow, prefill: PrefillRates) -> None:
        self._registry = registry
        self._pairs = pairs
        self._prefill = prefill

    def attempt_failed(
        self, request_id: str, backend_id: str, failure: Failure, detail: str
    ) -> None:
        """Before the first byte: the shim retries on its next fallback."""
        self.demote(request_id, backend_id, failure, detail)
        retry = Retry(failure=failure, detail=detail)
        self._registry.events.record(retry, request_id=request_id, backend_id=backend_id)

    def demote(self, request_id: str, backend_id: str, failure: Failure, detail: str) -> None:
        """`backend_id` failed `request_id` for real: demoted, and the request's load freed."""
        reason = f"{failure}: {detail}" if detail else failure
        self._registry.report_failure(backend_id, reason)
        self._registry.release(request_id)

    def finished(self, outcomes: Iterable[RequestOutcome], now: float) -> None:
        reg = self._registry
        for outcome in outcomes:
            reg.release(outcome.request_id)
            reached = reg.tenants.finished(
                outcome.request_id, outcome.prompt_tokens, outcome.completion_tokens, now,
                refused=outcome.engine_refused, model=outcome.model,
                cached_tokens=outcome.cached_tokens, tenant_id=outcome.tenant,
                served=bool(outcome.backend_id),
            )  # fmt: skip
            for standing in reached:
                reg.events.record(budget_event(standing), request_id=outcome.request_id)
            if outcome.ok and outcome.ttft_ms > 0:
                self._prefill.observed(outcome.request_id, outcome.backend_id, outcome.ttft_ms,
                                       outcome.prompt_tokens)  # fmt: skip
            if outcome.ok and outcome.blocks is not None:
                reg.placement.learn_blocks(
                    outcome.blocks, outcome.reply_chain_hash, outcome.prompt_tokens
                )
            if (s := outcome.spec) is not None:
                flags = [
                    n
                    for n, bad in (
                        ("repeated n-gram loop", s.repeated_ngram),
                        ("schema violation", s.schema_violation),
                    )
                    if bad
                ]
                self._pairs.spec_outcome(s.pair_id, s.target_id, s.rounds, s.drafted,
                                         s.accepted, not flags, ", ".join(flags))  # fmt: skip
            if outcome.ok and outcome.reply_chain_hash and outcome.backend_id:
                # The next turn's prefix ends with this reply: pin it where it was generated.
                reg.placement.pin_reply(
                    outcome.reply_chain_hash,
                    BackendId(outcome.backend_id),
                    outcome.message_count + 1,
                    now,
                )


def budget_event(s: Standing) -> BudgetReached:
    cal = s.budget.calendar
    return BudgetReached(tenant=s.tenant_id, period=cal.period.value, zone=cal.zone,
                         soft=s.budget.soft, amount=money(s.budget.amount), spent=money(s.spent),
                         reset=s.reset_text())  # fmt: skip
