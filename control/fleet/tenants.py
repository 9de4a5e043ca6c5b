"""Tenants: who may use the fleet (their keys, by digest), and what each used. The
configuration is the operator's (persisted with the fleet); what each is using now is the
shared ledger's (baton/ledger.py), soft state rebuilt from traffic. Admission is one call in
control's route decision, which sees every shim's requests, so a tenant's limits hold across
all shims, not per shim."""

# baton: pure

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from baton.ledger import Admission, Ledger
from baton.tenancy import Limits, Priority, Tenant, TenantKey, id_problem
from control.exceptions import ConfigError, TenantExists, TenantNotFound

USAGE_MINUTES = 24 * 60  # how far back `baton tenants usage --since` can look


@dataclass
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queued_s: float = 0.0
    refused: Counter[str] = field(default_factory=Counter)

    def add(self, other: _Counts) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.queued_s += other.queued_s
        self.refused.update(other.refused)


@dataclass(frozen=True, slots=True)
class Usage:
    tenant_id: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    refused: dict[str, int]
    in_flight: int
    queued_s: float


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
        self, tenants: Iterable[Tenant] = (), *, on_change: Callable[[], None] | None = None
    ) -> None:
        self._tenants: dict[str, Tenant] = {}
        self._ledger = Ledger()
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

    def update(self, tenant_id: str, priority: Priority, weight: int, limits: Limits) -> Tenant:
        t = replace(self.get(tenant_id), priority=priority, weight=weight, limits=limits)
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
        self, request_id: str, tenant_id: str, model: str, tokens: int, now: float
    ) -> Admission:
        """The ledger's admission (baton/ledger.py) against the tenant's whole limits."""
        if self.journal is not None:
            self.journal(("admit", request_id, tenant_id, model, tokens, now))
        tenant = self._tenants.get(tenant_id)
        admission = self._ledger.admit(request_id, tenant_id, tenant, model, tokens, now)
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
        a request admitted)."""
        if self.journal is not None:
            self.journal(("cancel", request_id))
        self._ledger.cancel(request_id)

    def finished(
        self,
        request_id: str,
        prompt_tokens: int,
        completion_tokens: int,
        now: float,
        refused: bool = False,
    ) -> None:
        """`refused`: the engine refused the request (a 4xx): it used no tokens."""
        if self.journal is not None:
            self.journal(("finished", request_id, prompt_tokens, completion_tokens, now, refused))
        tenant_id = self._ledger.finished(request_id, prompt_tokens, completion_tokens, refused)
        if tenant_id is not None:
            for counts in self._minutes(tenant_id).now(now):
                counts.prompt_tokens += prompt_tokens
                counts.completion_tokens += completion_tokens

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
        return self._ledger.expire(now)

    def _minutes(self, tenant_id: str) -> _Minutes:
        return self._counts.setdefault(tenant_id, _Minutes())

    def usage(self, since: float | None = None, *, lifetime: bool = False) -> list[Usage]:
        """Per tenant (configured, or seen since control started), since `since` (unix
        seconds, to the minute; None: as far back as kept), or since control started
        (`lifetime`: what Prometheus' counters say)."""
        out = []
        for tid in sorted(set(self._tenants) | set(self._counts)):
            m = self._counts.get(tid)
            if m is None:
                total = _Counts()
            else:
                total = m.total if lifetime else m.since(since)
            now_in = self._ledger.in_flight(tid)
            out.append(Usage(tid, total.requests, total.prompt_tokens, total.completion_tokens,
                             dict(total.refused), now_in, total.queued_s))  # fmt: skip
        return out

