"""What each tenant has spent over its budgets' periods, and whether one more request fits:
the one spend accounting both sides use, as baton/ledger.py is for rates. Control runs one
for the fleet (in the route decision, so a budget holds across every shim); a shim runs its
own only while control is unreachable, over a `share` of each budget.

A tenant has any number of budgets (50 a day and 1000 a month, each on its own time zone's
calendar, baton/periods.py); budgets on the same calendar share one spend. Money is integer
units (baton/pricing.py), so spend never drifts.

- Admission charges a request its estimated cost (its prompt and max_tokens at the model's
  price) while it is in flight, and admits it while every hard budget's spend, counting what
  is in flight, is under the budget. So concurrent requests overshoot a budget by at most
  what was in flight when it was reached: one request's estimate when they come one at a
  time, plus whatever the estimates undercounted. The estimate is what tokens per minute
  uses too; a request at a budget is refused until the period resets, which the refusal says.
- The request's end replaces the estimate by its real cost, once per request id (a failover
  and a resume report one end, over the whole generation); an end that says nothing keeps
  the estimate, a request no backend took (cancel) costs nothing. A request is charged to
  the period it was admitted in, even when it ends after that period rolled over.
- A budget reached (soft or hard) is reported once per period, when a settled cost reaches
  it: a soft budget only reports (an audit event, a metric), it never refuses.
- Persistence reads the settled spend per (tenant, period key): `unwritten()` rows since the
  last write, acknowledged with `written()` once stored (a failed write leaves them unwritten,
  so nothing is lost while the store is away), and `restore()` after a restart. A period
  that ended is dropped once written and no request in flight holds it: memory holds the
  current periods, plus those not yet stored."""

# baton: pure

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from baton.budgets import Budget, Refusal, SpendRow, Standing
from baton.periods import Calendar, Span

HOLD_TTL_S = 900.0  # an admitted request whose end was never reported (its shim died)
DONE_KEPT = 65_536  # ends remembered, so one reported twice is charged once


class _Spend:
    """One tenant's spend over one period, shared by its budgets on that calendar."""

    __slots__ = ("tenant_id", "key", "ident", "start", "end", "settled", "pending", "holds",
                 "written", "base", "told")  # fmt: skip

    def __init__(self, tenant_id: str, key: str, start: int, end: int) -> None:
        self.tenant_id, self.key, self.start, self.end = tenant_id, key, start, end
        self.ident = (tenant_id, key)  # its key in the ledger
        self.settled = 0  # costs of requests that ended
        self.pending = 0  # estimates of requests in flight
        self.holds = 0  # requests in flight
        self.written = 0  # settled as last stored
        self.base = 0  # settled as last restored: a shim's share is of what is left above it
        self.told: set[int] = set()  # budget amounts reported reached

    def row(self) -> SpendRow:
        return SpendRow(self.tenant_id, self.key, self.start, self.end, self.settled,
                        tuple(sorted(self.told)))  # fmt: skip


Line = tuple[Budget, _Spend]


class _Account:
    """A tenant's budgets bound to their current periods: what admission reads."""

    __slots__ = ("budgets", "lines", "hard", "spends", "start", "end")

    def __init__(self, budgets: tuple[Budget, ...], lines: tuple[Line, ...]) -> None:
        self.budgets = budgets
        self.lines = lines
        self.hard = tuple(line for line in lines if not line[0].soft)
        self.spends = tuple(dict.fromkeys(s for _, s in lines))  # each once, in order
        self.start = max(s.start for s in self.spends)
        self.end = min(s.end for s in self.spends)


# An admitted request until it ends: (tenant id, estimate, the account it was admitted on,
# since when). A tuple: made on every admission, and a tuple is the cheapest thing to make.
_Hold = tuple[str, int, _Account, float]


class SpendLedger:
    """`now` is control's clock (the shim's, in a shim), passed in; it is taken not to go
    back across a period's end."""

    def __init__(self, *, persisted: bool = True) -> None:
        """`persisted`: spend is written somewhere (control); a shim's ledger, whose spend
        control learns from the shim's reports, is not, and drops a period once it ended."""
        self._persisted = persisted
        self._spends: dict[tuple[str, str], _Spend] = {}
        self._accounts: dict[str, _Account] = {}
        self._holds: dict[str, _Hold] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._done: set[str] = set()
        self._done_order: deque[str] = deque()

    # -- admission and ends -----------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        tenant_id: str,
        budgets: tuple[Budget, ...],
        cost: int,
        now: float,
        share: int = 1,
    ) -> Refusal | None:
        """None: admitted, and `cost` (the estimate, in units) is held against each of the
        tenant's periods until `finished` or `cancel`. A tenant without budgets is admitted
        and not counted. `share`: of how many shims this one enforces a part (1: whole)."""
        if not budgets or request_id in self._holds:  # a request admitted once is held once
            return None
        acct = self._accounts.get(tenant_id)
        if acct is None or acct.budgets is not budgets or not acct.start <= now < acct.end:
            acct = self._bind(tenant_id, budgets, now)
        if share <= 1:
            for b, s in acct.hard:
                if s.settled + s.pending >= b.amount:
                    return self._refusal(acct, 1)
        elif any(s.settled + s.pending >= _limit(b, s, share) for b, s in acct.hard):
            return self._refusal(acct, share)
        for s in acct.spends:
            s.pending += cost
            s.holds += 1
        self._holds[request_id] = (tenant_id, cost, acct, now)
        return None

    def cancel(self, request_id: str) -> str | None:
        """An admitted request no backend could take: it cost nothing. Its tenant's id."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return None
        self._release(hold, None)
        return hold[0]

    def finished(
        self,
        request_id: str,
        cost: int | None,
        now: float,
        *,
        tenant_id: str = "",
        budgets: tuple[Budget, ...] = (),
    ) -> tuple[Standing, ...] | None:
        """The request ended and cost `cost` units (the engine's usage at the model's price);
        None: its usage is unknown (a client gone, an engine that failed), the estimate
        stands. Charged once per request id. A request this ledger did not admit (admitted
        by another leader, or by a shim while control was away) is charged now to
        `tenant_id`'s current periods when the caller names them. The budgets this cost
        reached (each reported once a period; usually none), or None: nothing was charged."""
        hold = self._holds.pop(request_id, None)
        if hold is None:
            if not tenant_id or not budgets or request_id in self._done:
                return None
            acct = self._current(tenant_id, budgets, now)
            actual = cost if cost is not None and cost > 0 else 0
        else:
            acct = hold[2]
            actual = hold[1] if cost is None else cost if cost > 0 else 0
        self._remember(request_id)
        if actual:
            for s in acct.spends:
                s.settled += actual
                if self._persisted:
                    self._dirty.add(s.ident)
        crossed = self._crossed(acct.lines)
        if hold is not None:
            self._release(hold, now)
        return crossed

    def expire(self, now: float) -> tuple[Standing, ...]:
        """Requests whose end was never reported (their shim died), charged their estimate
        (the budgets that reached); and periods that ended, let go once nothing holds them
        (called now and then)."""
        stale = [rid for rid, h in self._holds.items() if now - h[3] > HOLD_TTL_S]
        crossed = [c for rid in stale for c in self.finished(rid, None, now) or ()]
        for spend in list(self._spends.values()):
            self._drop_if_done(spend, now)
        return tuple(crossed)

    def standing(
        self, tenant_id: str, budgets: tuple[Budget, ...], now: float, share: int = 1
    ) -> tuple[Standing, ...]:
        """Each budget's standing now (for `baton tenants usage`, metrics, rate headers)."""
        if not budgets:
            return ()
        acct = self._current(tenant_id, budgets, now)
        return tuple(_standing(b, s, share) for b, s in acct.lines)

    def _refusal(self, acct: _Account, share: int) -> Refusal:
        reached = [(b, s) for b, s in acct.hard if s.settled + s.pending >= _limit(b, s, share)]
        b, s = max(reached, key=lambda line: line[1].end)
        return Refusal(_standing(b, s, share))

    def _crossed(self, lines: tuple[Line, ...]) -> tuple[Standing, ...]:
        out: tuple[Standing, ...] = ()
        for b, s in lines:
            if s.settled >= b.amount and s.settled > 0 and b.amount not in s.told:
                s.told.add(b.amount)
                if self._persisted:
                    self._dirty.add(s.ident)
                out += (_standing(b, s, 1),)
        return out

    def _release(self, hold: _Hold, now: float | None) -> None:
        """A request's estimate no longer held; a period it kept after its end is let go."""
        estimate = hold[1]
        for s in hold[2].spends:
            s.pending -= estimate
            s.holds -= 1
            if now is not None and s.end <= now:
                self._drop_if_done(s, now)

    def _drop_if_done(self, s: _Spend, now: float) -> None:
        """Forget a period that ended, once no request holds it and its spend is stored."""
        k = s.ident
        if s.end <= now and s.holds == 0 and k not in self._dirty and self._spends.get(k) is s:
            del self._spends[k]

    def _remember(self, request_id: str) -> None:
        if not request_id:
            return
        self._done.add(request_id)
        self._done_order.append(request_id)
        if len(self._done_order) > DONE_KEPT:
            self._done.discard(self._done_order.popleft())

    # -- the current periods ----------------------------------------------------------------

    def _current(self, tenant_id: str, budgets: tuple[Budget, ...], now: float) -> _Account:
        acct = self._accounts.get(tenant_id)
        if acct is not None and acct.budgets is budgets and acct.start <= now < acct.end:
            return acct
        return self._bind(tenant_id, budgets, now)

    def _bind(self, tenant_id: str, budgets: tuple[Budget, ...], now: float) -> _Account:
        """The tenant's budgets on the periods that hold `now`: after a period rolled over, or
        its budgets changed. Equal budgets in a new tuple (a shim's new snapshot) keep theirs."""
        old = self._accounts.get(tenant_id)
        if old is not None and old.start <= now < old.end and old.budgets == budgets:
            old.budgets = budgets
            return old
        spans: dict[Calendar, Span] = {}
        lines = []
        for b in budgets:
            span = spans.get(b.calendar)
            if span is None:
                span = spans[b.calendar] = b.calendar.span(now)
            spend = self._spends.get((tenant_id, span.key))
            if spend is None:
                spend = self._spends[tenant_id, span.key] = _Spend(
                    tenant_id, span.key, span.start, span.end
                )
            lines.append((b, spend))
        acct = self._accounts[tenant_id] = _Account(budgets, tuple(lines))
        for s in old.spends if old is not None else ():
            self._drop_if_done(s, now)  # rolled over: the last period, unless still needed
        return acct

    # -- persistence ------------------------------------------------------------------------

    def unwritten(self) -> tuple[SpendRow, ...]:
        """Spend changed since it was last stored: rows to write (whole values, so a write
        can be repeated), then acknowledge with `written`."""
        return tuple(self._spends[k].row() for k in sorted(self._dirty) if k in self._spends)

    @property
    def unwritten_units(self) -> int:
        """Spend not stored yet, in units: what a crash now would lose (a metric)."""
        return sum(max(self._spends[k].settled - self._spends[k].written, 0)
                   for k in self._dirty if k in self._spends)  # fmt: skip

    def written(self, rows: Iterable[SpendRow], now: float) -> None:
        """`rows` are stored. Those that changed again since stay unwritten. Periods that
        ended, with nothing in flight and nothing unwritten, are dropped."""
        for r in rows:
            k = (r.tenant_id, r.key)
            s = self._spends.get(k)
            if s is None:
                continue
            s.written = r.spent
            if r.spent == s.settled and r.notified == tuple(sorted(s.told)):
                self._dirty.discard(k)
            self._drop_if_done(s, now)

    def rows(self) -> tuple[SpendRow, ...]:
        """Every period held, written or not (a full copy for a new follower)."""
        return tuple(s.row() for _, s in sorted(self._spends.items()))

    def restore(self, rows: Iterable[SpendRow], now: float) -> None:
        """The spend as stored, after a restart (or a shim's last word from control): rows of
        periods that ended are history, not needed to enforce anything, and left out."""
        for r in rows:
            if r.end <= now:
                continue
            k = (r.tenant_id, r.key)
            s = self._spends.get(k)
            if s is None:
                s = self._spends[k] = _Spend(r.tenant_id, r.key, r.start, r.end)
            s.settled = s.written = s.base = r.spent
            s.told = set(r.notified)
            self._dirty.discard(k)


def _limit(b: Budget, s: _Spend, share: int) -> int:
    """What this ledger may let the tenant reach: the budget whole, or (a shim while control
    is away) its share of what was left when the spend was last restored."""
    if share <= 1:
        return b.amount
    base = min(s.base, b.amount)
    return base + (b.amount - base) // share


def _standing(b: Budget, s: _Spend, share: int) -> Standing:
    return Standing(s.tenant_id, b, s.key, _limit(b, s, share), s.settled, s.pending, s.start,
                    s.end)  # fmt: skip
