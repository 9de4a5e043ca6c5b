"""Tenants: who may use the fleet (their keys, by digest), and what each used. The
configuration is the operator's (persisted with the fleet); what each is using now is the
shared ledger's (baton/ledger.py), soft state rebuilt from traffic. Admission is one call in
control's route decision, which sees every shim's requests, so a tenant's limits hold across
all shims, not per shim. So do its spend budgets (baton/spend.py): each request is charged
its estimated cost at admission, and its cost from the engine's usage at its end, at the
model's price (baton/pricing.py)."""

# baton: pure

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from baton import charging
from baton.budgets import Budget, Standing
from baton.ledger import Admission, Ledger
from baton.pricing import PriceTable
from baton.spend import SpendLedger
from baton.tenancy import Limits, Priority, Tenant, TenantKey, id_problem
from baton.usage_days import UsageDays
from control.exceptions import ConfigError, TenantExists, TenantNotFound

USAGE_MINUTES = 24 * 60  # how far back `baton tenants usage --since` can look


@dataclass
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queued_s: float = 0.0
    refused: Counter[str] = field(default_factory=Counter)
    cost: int = 0  # units (baton/pricing.py)

    def add(self, other: _Counts) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.queued_s += other.queued_s
        self.refused.update(other.refused)
        self.cost += other.cost


@dataclass(frozen=True, slots=True)
class Usage:
    tenant_id: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    refused: dict[str, int]
    in_flight: int
    queued_s: float
    cost: int = 0  # units
    budgets: tuple[Standing, ...] = ()  # each budget in its current period


class _Minutes:
    """One tenant's counts, minute by minute (unix minutes) for usage reports, and since
    control started (Prometheus' counters, which never go down)."""

    def __init__(self) -> None:
        self.minutes: deque[tuple[int, _Counts]] = deque()
        self.total = _Counts()

    def now(self, now: float) -> tuple[_Counts, _Counts]:
        """This minute's counts and the total, both to be added to."""
        minute = int(now // 60)
        if not self.minutes or self.minutes[-1][0] != minute:
            self.minutes.append((minute, _Counts()))
            while self.minutes and self.minutes[0][0] <= minute - USAGE_MINUTES:
                self.minutes.popleft()
        return self.minutes[-1][1], self.total

    def since(self, since: float | None) -> _Counts:
        total = _Counts()
        for minute, c in self.minutes:
            if since is None or (minute + 1) * 60 > since:
                total.add(c)
        return total


class TenantBook:
    def __init__(
        self,
        tenants: Iterable[Tenant] = (),
        *,
        on_change: Callable[[], None] | None = None,
        prices: PriceTable | None = None,
    ) -> None:
        self._tenants: dict[str, Tenant] = {}
        self._ledger = Ledger()
        self.prices = prices if prices is not None else PriceTable()
        self._spend = SpendLedger()
        self._days = UsageDays()  # per tenant, model and UTC day: reports and export
        # Budgets reached (soft or hard), by (tenant, period, soft): a metric's counts.
        self.reached: Counter[tuple[str, str, bool]] = Counter()
        self._counts: dict[str, _Minutes] = {}
        self._on_change = on_change
        # While a leader replica has followers: each use as an op (control/fleet/journal.py),
        # so no tenant gets a fresh window when the leader changes.
        self.journal: Callable[[tuple[object, ...]], None] | None = None
        for t in tenants:
            self._check(t)
            if t.id in self._tenants:
                raise ConfigError(f"tenant {t.id!r} is listed twice")
            self._tenants[t.id] = t
        self._check_keys()

    # -- configuration ------------------------------------------------------------------

    @property
    def spend(self) -> SpendLedger:
        """The spend ledger (its rows are what control/server/spend_flush.py writes)."""
        return self._spend

    @property
    def days(self) -> UsageDays:
        """Use per tenant, model and UTC day (written beside the spend, the same way)."""
        return self._days

    def all(self) -> tuple[Tenant, ...]:
        return tuple(self._tenants[i] for i in sorted(self._tenants))

    def find(self, tenant_id: str) -> Tenant | None:
        return self._tenants.get(tenant_id)

    def get(self, tenant_id: str) -> Tenant:
        t = self._tenants.get(tenant_id)
        if t is None:
            raise TenantNotFound(f"no tenant {tenant_id!r}")
        return t

    def add(self, tenant: Tenant, key_digest: bytes, now: float) -> Tenant:
        """The tenant with its first key, by digest (the key itself is its caller's to show
        once: control/api/admin.py makes it)."""
        self._check(tenant)
        if tenant.id in self._tenants:
            raise TenantExists(f"tenant {tenant.id!r} exists")
        added = replace(tenant, keys=(TenantKey(key_digest, now),))
        self._tenants[tenant.id] = added
        self._changed()
        return added

    def update(
        self,
        tenant_id: str,
        priority: Priority,
        weight: int,
        limits: Limits,
        budgets: tuple[Budget, ...] | None = None,
    ) -> Tenant:
        """`budgets` None: kept as they are."""
        t = replace(self.get(tenant_id), priority=priority, weight=weight, limits=limits)
        if budgets is not None and budgets != t.budgets:
            t = replace(t, budgets=budgets)
        self._check(t)
        self._tenants[tenant_id] = t
        self._changed()
        return t

    def remove(self, tenant_id: str) -> None:
        self.get(tenant_id)
        del self._tenants[tenant_id]
        self._changed()

    def add_key(self, tenant_id: str, key_digest: bytes, now: float) -> Tenant:
        t = self.get(tenant_id)
        t = replace(t, keys=(*t.keys, TenantKey(key_digest, now)))
        self._tenants[tenant_id] = t
        self._changed()
        return t

    def revoke_key(self, tenant_id: str, key_id: str) -> Tenant:
        t = self.get(tenant_id)
        kept = tuple(k for k in t.keys if k.key_id != key_id)
        if len(kept) == len(t.keys):
            raise TenantNotFound(f"tenant {tenant_id!r} has no key {key_id!r}")
        t = replace(t, keys=kept)
        self._tenants[tenant_id] = t
        self._changed()
        return t

    def replace(self, tenants: Iterable[Tenant]) -> None:
        """The tenants as the store now says (a follower replica, or a write undone); each
        tenant's use so far is kept."""
        wanted = {t.id: t for t in tenants}
        for t in wanted.values():
            self._check(t)
        if wanted != self._tenants:
            before, self._tenants = self._tenants, wanted
            try:
                self._check_keys()
            except ConfigError:
                self._tenants = before
                raise
            self._changed()

    def set_prices(self, prices: PriceTable) -> None:
        """The price table from now on (`baton prices`, or the store's): requests admitted
        or settled after this are priced by it, and the next snapshot carries it to shims."""
        if prices != self.prices:
            self.prices = prices
            self._changed()

    def _check(self, t: Tenant) -> None:
        why = id_problem(t.id)
        if why is not None:
            raise ConfigError(f"tenant {t.id!r}: {why}")
        if t.weight < 1:
            raise ConfigError(f"tenant {t.id!r}: weight must be at least 1")
        for name, v in t.limits.rates():
            if v is not None and v < 1:
                raise ConfigError(f"tenant {t.id!r}: {name} must be at least 1 (or absent)")

    def _check_keys(self) -> None:
        seen: dict[bytes, str] = {}
        for t in self._tenants.values():
            for k in t.keys:
                if seen.setdefault(k.digest, t.id) != t.id:
                    raise ConfigError(f"tenants {seen[k.digest]!r} and {t.id!r} share a key")

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    # -- admission and use ---------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        tenant_id: str,
        model: str,
        tokens: int,
        now: float,
        output_tokens: int = 0,
    ) -> Admission:
        """The tenant's budgets first (a refusal there charges nothing), then the ledger's
        admission (baton/ledger.py) against its whole limits. `tokens`: the request's
        estimate, `output_tokens` of them its max_tokens (priced at the output price)."""
        if self.journal is not None:
            self.journal(("admit", request_id, tenant_id, model, tokens, now, output_tokens))
        tenant = self._tenants.get(tenant_id)
        admission = None
        budgeted = False
        if tenant is not None and tenant.budgets and tenant.limits.allows(model):
            budgeted = True
            cost = charging.estimate(self.prices, model, tokens, output_tokens)
            refusal = self._spend.admit(request_id, tenant_id, tenant.budgets, cost, now)
            if refusal is not None:
                admission = charging.over_budget(refusal, now)
        if admission is None:
            admission = self._ledger.admit(request_id, tenant_id, tenant, model, tokens, now)
            if budgeted and admission.refused is not None:
                self._spend.cancel(request_id)
        if tenant is not None:
            for counts in self._minutes(tenant_id).now(now):
                if admission.refused is None:
                    counts.requests += 1
                else:
                    limit = admission.limited.value if admission.limited else "model"
                    counts.refused[limit] += 1
        return admission

    def cancel(self, request_id: str) -> None:
        """An admitted request no backend could take: it used nothing (it stays counted as
        a request admitted) and cost nothing."""
        if self.journal is not None:
            self.journal(("cancel", request_id))
        self._ledger.cancel(request_id)
        self._spend.cancel(request_id)

    def finished(
        self,
        request_id: str,
        prompt_tokens: int,
        completion_tokens: int,
        now: float,
        refused: bool = False,
        *,
        model: str = "",
        cached_tokens: int = 0,
        tenant_id: str = "",
        served: bool = True,
    ) -> tuple[Standing, ...]:
        """`refused`: the engine refused the request (a 4xx): it used no tokens. `served`:
        a backend took it (False: none did, or its client left before its route). Its cost
        at `model`'s price settles its tenant's spend once per request id, whichever shim
        admitted it (`tenant_id`: for one a shim admitted while control was away). The
        budgets this end reached, soft or hard (each once a period; usually none)."""
        if self.journal is not None:
            self.journal(("finished", request_id, prompt_tokens, completion_tokens, now, refused,
                          model, cached_tokens, tenant_id, served))  # fmt: skip
        admitted = self._ledger.finished(request_id, prompt_tokens, completion_tokens, refused)
        tid = admitted or (tenant_id if tenant_id in self._tenants else "")
        cost = charging.cost(self.prices, model, prompt_tokens, cached_tokens,
                             completion_tokens, generated=served and not refused)  # fmt: skip
        tenant = self._tenants.get(tid) if tid else None
        crossed = self._spend.finished(request_id, cost, now, tenant_id=tid,
                                       budgets=tenant.budgets if tenant else ())  # fmt: skip
        if tid:
            for counts in self._minutes(tid).now(now):
                counts.prompt_tokens += prompt_tokens
                counts.completion_tokens += completion_tokens
                counts.cost += cost or 0
            if served and not refused:
                self._days.add(request_id, tid, model, prompt_tokens, cached_tokens,
                               completion_tokens, cost or 0, now)  # fmt: skip
        for s in crossed or ():
            self.reached[(s.tenant_id, s.budget.calendar.period.value, s.budget.soft)] += 1
        return crossed or ()

    def waited(self, tenant_id: str, seconds: float, shed: bool, now: float) -> None:
        """A request of the tenant waited `seconds` for room on a saturated fleet, and was
        routed, or `shed` past its bound."""
        if self.journal is not None:
            self.journal(("waited", tenant_id, seconds, shed, now))
        if tenant_id not in self._tenants:
            return
        for counts in self._minutes(tenant_id).now(now):
            counts.queued_s += seconds
            if shed:
                counts.refused["saturated"] += 1

    def expire(self, now: float) -> int:
        for s in self._spend.expire(now):
            self.reached[(s.tenant_id, s.budget.calendar.period.value, s.budget.soft)] += 1
        return self._ledger.expire(now)

    def standing(self, tenant_id: str, now: float) -> tuple[Standing, ...]:
        """Each of the tenant's budgets in its current period (none: no budgets)."""
        t = self._tenants.get(tenant_id)
        return self._spend.standing(tenant_id, t.budgets, now) if t is not None else ()

    def _minutes(self, tenant_id: str) -> _Minutes:
        return self._counts.setdefault(tenant_id, _Minutes())

    def usage(
        self, since: float | None = None, *, lifetime: bool = False, now: float | None = None
    ) -> list[Usage]:
        """Per tenant (configured, or seen since control started), since `since` (unix
        seconds, to the minute; None: as far back as kept), or since control started
        (`lifetime`: what Prometheus' counters say). `now`: with each budget's standing."""
        out = []
        for tid in sorted(set(self._tenants) | set(self._counts)):
            m = self._counts.get(tid)
            if m is None:
                total = _Counts()
            else:
                total = m.total if lifetime else m.since(since)
            now_in = self._ledger.in_flight(tid)
            budgets = self.standing(tid, now) if now is not None else ()
            out.append(Usage(tid, total.requests, total.prompt_tokens, total.completion_tokens,
                             dict(total.refused), now_in, total.queued_s, total.cost,
                             budgets))  # fmt: skip
        return out

