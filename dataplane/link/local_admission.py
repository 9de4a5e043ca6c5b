"""A shim's own admission while control is unreachable: each tenant's share of its limits
(baton/ledger.py) and of its spend budgets (baton/spend.py), counted here alone over the
requests this shim admits in the meantime. `share` is the number of shims control last
said were live, so the fleet stays within about each limit and budget, never open and never
shut. Requests control admitted are not in it; what this shim admits reaches control's
accounting through its outcome reports (with the tenant's id) once control is back.

A shim's budget share is of the whole budget: control does not send tenants' spend to shims
yet, so a tenant near its budget when control went away can spend up to a share more here."""

# baton: pure

from __future__ import annotations

from baton import charging
from baton.ledger import Admission, Ledger
from baton.model import Decision, RequestOutcome, RequestShape, Snapshot
from baton.spend import SpendLedger
from baton.tenancy import Tenant


class LocalAdmission:
    def __init__(self) -> None:
        self._ledger = Ledger()
        self._spend = SpendLedger(persisted=False)

    def admit(
        self,
        request_id: str,
        shape: RequestShape,
        snapshot: Snapshot,
        tenant: Tenant | None,
        now: float,
        share: int,
    ) -> Decision | None:
        """The tenant's budgets, then its limits, at `share`; None: admitted (and counted
        until `finished` or `cancel`), else the refusal as control would decide it."""
        admission: Admission | None = None
        budgeted = tenant is not None and bool(tenant.budgets)
        if tenant is not None and budgeted and tenant.limits.allows(shape.model):
            cost = charging.estimate(snapshot.prices, shape.model, shape.tokens_estimate(),
                                     shape.max_tokens)  # fmt: skip
            refusal = self._spend.admit(request_id, shape.tenant, tenant.budgets, cost, now,
                                        share=share)  # fmt: skip
            if refusal is not None:
                admission = charging.over_budget(refusal, now)
        if admission is None:
            admission = self._ledger.admit(request_id, shape.tenant, tenant, shape.model,
                                           shape.tokens_estimate(), now, share=share)  # fmt: skip
            if admission.refused is not None:
                self._spend.cancel(request_id)
        if admission.refused is None:
            return None
        return Decision((), admission.refused, snapshot.version, admission.detail,
                        quota=admission.quota)  # fmt: skip

    def cancel(self, request_id: str) -> None:
        """Admitted, but no backend could take it: it used and cost nothing."""
        self._ledger.cancel(request_id)
        self._spend.cancel(request_id)

    def finished(self, outcome: RequestOutcome, snapshot: Snapshot, now: float) -> None:
        o = outcome
        self._ledger.finished(o.request_id, o.prompt_tokens, o.completion_tokens,
                              o.engine_refused)  # fmt: skip
        cost = charging.cost(snapshot.prices, o.model, o.prompt_tokens, o.cached_tokens,
                             o.completion_tokens,
                             generated=bool(o.backend_id) and not o.engine_refused)  # fmt: skip
        self._spend.finished(o.request_id, cost, now)
