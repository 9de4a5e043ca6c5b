"""What each tenant is using now, and whether one more request fits its limits: the one
accounting both sides use. Control runs one ledger for the whole fleet (its admission, in the
route decision, sees every shim's requests, so a limit holds across shims); a shim runs its
own only while control is unreachable, over a share of each limit (`share`: the shims control
last said were live), so the fleet stays within about its limits, never open and never shut.

Windows: requests and tokens per minute are counted over the last 60 s, entry by entry (a
sliding log, exact; its entries are bounded by the limit's own rate). Tokens are charged at
admission as an estimate (the prompt from its characters, plus the client's max_tokens) and
corrected to the engine's usage when the request ends. A request is admitted while the
window is under the limit, so a tenant goes over its tokens per minute by at most the
requests admitted just under it: one request's tokens when they come one at a time."""

# baton: pure

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from baton.model import Reason
from baton.tenancy import FILE_TENANT, WINDOW_S, Limited, Limits, Quota, Tenant

HOLD_TTL_S = 900.0  # an admitted request whose end was never reported (its shim died)


class _Window:
    """Amounts charged in the last WINDOW_S seconds. An entry is a [time, amount] list, so
    a charge can be corrected in place when the request ends."""

    def __init__(self) -> None:
        self._entries: deque[list[float]] = deque()
        self.used = 0.0

    def trim(self, now: float) -> None:
        while self._entries and now - self._entries[0][0] >= WINDOW_S:
            self.used -= self._entries.popleft()[1]
        if not self._entries:
            self.used = 0.0  # no drift from float sums

    def charge(self, now: float, amount: float) -> list[float]:
        entry = [now, amount]
        self._entries.append(entry)
        self.used += amount
        return entry

    def correct(self, entry: list[float], amount: float) -> None:
        """The request's real amount, if its entry is still in the window."""
        if self._entries and entry[0] >= self._entries[0][0]:
            self.used += amount - entry[1]
            entry[1] = amount

    def until_under(self, limit: float, now: float) -> float:
        """Seconds until what is used falls below `limit` as entries age out."""
        used = self.used
        for t, amount in self._entries:
            if used < limit:
                break
            used -= amount
            wait = t + WINDOW_S - now
            if used < limit:
                return max(wait, 0.0)
        return 0.0

    def until_empty(self, now: float) -> float:
        return max(self._entries[-1][0] + WINDOW_S - now, 0.0) if self._entries else 0.0


@dataclass
class _Hold:
    """An admitted request, until it ends."""

    tenant_id: str
    since: float
    tokens: list[float] | None  # its entry in the tenant's token window


@dataclass(frozen=True, slots=True)
class Admission:
    """`refused` None: admitted. `limited`: which limit refused it (TENANT_LIMITED)."""

    refused: Reason | None = None
    detail: str = ""
    quota: Quota | None = None
    limited: Limited | None = None


ADMITTED = Admission()


class _Use:
    def __init__(self) -> None:
        self.in_flight = 0
        self.requests = _Window()
        self.tokens = _Window()


def shared(limit: int | None, share: int) -> int | None:
    """One of `share` shims' part of a limit: at least 1, so a tenant is never shut out."""
    return None if limit is None else max(1, limit // max(share, 1))


class Ledger:
    def __init__(self) -> None:
        self._use: dict[str, _Use] = {}
        self._holds: dict[str, _Hold] = {}

    def admit(
        self,
        request_id: str,
        tenant_id: str,
        tenant: Tenant | None,
        model: str,
        tokens: int,
        now: float,
        share: int = 1,
    ) -> Admission:
        """Whether the request may be routed now; when it may, it is counted (in flight, a
        request, `tokens` estimated) until `finished` or `cancel`. `tenant`: the tenant of
        that id, None when none is defined. An empty tenant id (an open shim) and the shims'
        flat key file's tenant, when none of that name is defined, are admitted unlimited."""
        if not tenant_id:
            return ADMITTED
        if tenant is None:
            if tenant_id == FILE_TENANT:
                return ADMITTED
            return Admission(Reason.TENANT_UNKNOWN, f"tenant {tenant_id!r} was removed")
        if not tenant.limits.allows(model):
            return Admission(Reason.TENANT_MODEL, f"tenant {tenant_id!r} may not use {model!r}")
        lim = tenant.limits
        if share > 1:
            lim = Limits(shared(lim.concurrent, share), shared(lim.requests_per_minute, share),
                         shared(lim.tokens_per_minute, share), lim.models)  # fmt: skip
        use = self._use.setdefault(tenant_id, _Use())
        use.requests.trim(now)
        use.tokens.trim(now)
        limited = _limited(lim, use)
        if limited is not None:
            quota = _quota(lim, use, now, limited)
            return Admission(Reason.TENANT_LIMITED, _refusal(tenant_id, limited, lim), quota,
                             limited)  # fmt: skip
        use.in_flight += 1
        use.requests.charge(now, 1)
        entry = use.tokens.charge(now, tokens) if lim.tokens_per_minute is not None else None
        self._holds[request_id] = _Hold(tenant_id, now, entry)
        return Admission(quota=_quota(lim, use, now, None))

    def cancel(self, request_id: str) -> str | None:
        """An admitted request no backend could take: it used nothing. Its tenant's id."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return None
        use = self._use[hold.tenant_id]
        use.in_flight -= 1
        if hold.tokens is not None:
            use.tokens.correct(hold.tokens, 0)
        return hold.tenant_id

    def finished(
        self, request_id: str, prompt_tokens: int, completion_tokens: int, refused: bool = False
    ) -> str | None:
        """The request ended: its tokens as the engine counted them replace the estimate.
        An end that says none keeps the estimate (a client gone, an engine that failed: work
        was done that nobody counted), unless the engine `refused` the request (a 4xx: it
        generated nothing). Its tenant's id; None for a request this ledger did not admit."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return None
        use = self._use[hold.tenant_id]
        use.in_flight -= 1
        used = prompt_tokens + completion_tokens
        if hold.tokens is not None and (used > 0 or refused):
            use.tokens.correct(hold.tokens, used)
        return hold.tenant_id

    def expire(self, now: float) -> int:
        """Holds of requests whose end was never reported (a shim died with them)."""
        stale = [rid for rid, h in self._holds.items() if now - h.since > HOLD_TTL_S]
        for rid in stale:
            self.finished(rid, 0, 0)
        return len(stale)

    def in_flight(self, tenant_id: str) -> int:
        use = self._use.get(tenant_id)
        return use.in_flight if use is not None else 0


def _limited(lim: Limits, use: _Use) -> Limited | None:
    if lim.concurrent is not None and use.in_flight >= lim.concurrent:
        return Limited.CONCURRENT
    if lim.requests_per_minute is not None and use.requests.used >= lim.requests_per_minute:
        return Limited.REQUESTS
    if lim.tokens_per_minute is not None and use.tokens.used >= lim.tokens_per_minute:
        return Limited.TOKENS
    return None


def _quota(lim: Limits, use: _Use, now: float, limited: Limited | None) -> Quota | None:
    rpm, tpm = lim.requests_per_minute or 0, lim.tokens_per_minute or 0
    if not (rpm or tpm or limited):
        return None
    retry = 0.0
    if limited is Limited.REQUESTS:
        retry = use.requests.until_under(rpm, now)
    elif limited is Limited.TOKENS:
        retry = use.tokens.until_under(tpm, now)
    elif limited is Limited.CONCURRENT:
        retry = 1.0  # a running request's end cannot be foreseen: a short wait
    return Quota(
        limit_requests=rpm,
        remaining_requests=max(rpm - int(use.requests.used), 0) if rpm else 0,
        reset_requests_s=use.requests.until_empty(now) if rpm else 0.0,
        limit_tokens=tpm,
        remaining_tokens=max(tpm - int(use.tokens.used), 0) if tpm else 0,
        reset_tokens_s=use.tokens.until_empty(now) if tpm else 0.0,
        retry_after_s=retry,
        limited_by=limited,
    )


def _refusal(tenant_id: str, limited: Limited, lim: Limits) -> str:
    if limited is Limited.CONCURRENT:
        return f"tenant {tenant_id!r} has {lim.concurrent} requests in flight, its limit"
    if limited is Limited.REQUESTS:
        return f"tenant {tenant_id!r} reached its {lim.requests_per_minute} requests per minute"
    return f"tenant {tenant_id!r} reached its {lim.tokens_per_minute} tokens per minute"
