"""Budget periods: an hour, a day, an ISO week (Monday first) or a calendar month, on the wall
clock of an IANA time zone (UTC by default). For an instant (unix seconds) a period has a
start, an end (when a budget resets) and a key, the stable name its spend is stored under.

Periods follow the wall clock, so they are not all the same length: a day in a zone with
daylight saving lasts 23 or 25 hours on the days the clocks change, a month 28 to 31 days.
An hour is a real hour: when the clocks fall back, the repeated wall hour is a second period
of its own (its key carries the UTC offset), never one period of two hours.

How: a period is the stretch of time whose local label (the hour, the date, the ISO week, the
month) is the same. Its bounds are first guessed from the wall clock (local midnight, the
first of the month) and then checked against that label one second either side; where the
guess is wrong (a 30-minute daylight-saving shift as on Lord Howe Island, or some oddity of
a zone's history) the bound is found by bisection instead. Zone offsets change only on whole
seconds, so bounds are whole seconds.

Spans are computed when a period rolls over, not per request (baton/budgets.py caches the
current one), so correctness is worth more here than speed."""

# baton: pure

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from enum import StrEnum
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

UTC = "UTC"


class Period(StrEnum):
    HOUR = "hour"
    DAY = "day"
    WEEK = "week"
    MONTH = "month"


PERIODS = ", ".join(p.value for p in Period)

# How far back or ahead a bisection looks for a bound: more than any period lasts, with room
# for a zone's history (Samoa skipped a day in 2011; some zones once moved by a whole day).
_REACH_S = {Period.HOUR: 3 * 3600, Period.DAY: 3 * 86400, Period.WEEK: 9 * 86400,
            Period.MONTH: 34 * 86400}  # fmt: skip

Label = tuple[int, ...]


def period(name: str) -> Period:
    """The period of that name; a ValueError that lists the periods otherwise."""
    try:
        return Period(name)
    except ValueError:
        raise ValueError(f"unknown period {name!r}: one of {PERIODS}") from None


def zone(name: str) -> ZoneInfo:
    """The IANA time zone of that name ("Europe/Berlin"); a ValueError otherwise (zoneinfo
    answers a KeyError subclass for an unknown name and a ValueError for a malformed one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a time zone is an IANA name such as 'Europe/Berlin', not {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown time zone {name!r}: an IANA name such as 'Europe/Berlin' or 'UTC'"
        ) from None


@dataclass(frozen=True, slots=True)
class Span:
    """One period: [start, end) in unix seconds; `end` is when a budget over it resets."""

    start: int
    end: int
    key: str

    def __contains__(self, t: float) -> bool:
        return self.start <= t < self.end


@dataclass(frozen=True, slots=True)
class Calendar:
    """A kind of period on one zone's wall clock. Built from strings (config, the CLI), so it
    checks them: an unknown period or zone is a ValueError naming it."""

    period: Period
    zone: str = UTC

    def __post_init__(self) -> None:
        object.__setattr__(self, "period", period(self.period))
        zone(self.zone)

    @classmethod
    def of(cls, period_name: str, zone_name: str = UTC) -> Calendar:
        """From the names an operator writes ("day", "Europe/Berlin")."""
        return cls(period(period_name), zone_name)

    @property
    def name(self) -> str:
        """The calendar as keys and labels show it: "day:Europe/Berlin"."""
        return f"{self.period}:{self.zone}"

    def span(self, t: float) -> Span:
        """The period that holds instant `t`."""
        tz = zone(self.zone)  # ZoneInfo caches zones by name: no file is read twice
        now = math.floor(t)
        label = self._labeller(tz)
        here = label(now)
        start = self._check_start(label, here, self._guess_start(now, tz), now)
        end = self._check_end(label, here, self._guess_end(start, tz), now)
        return Span(start, end, f"{self.name}:{self._key(start, tz)}")

    # -- the local label of an instant, and the wall clock's guess at the bounds ------------

    def _labeller(self, tz: ZoneInfo) -> Callable[[int], Label]:
        p = self.period

        def label(t: int) -> Label:
            d = datetime.fromtimestamp(t, tz)
            if p is Period.HOUR:
                return (d.year, d.month, d.day, d.hour, d.fold)  # fold: the repeated hour
            if p is Period.DAY:
                return (d.year, d.month, d.day)
            if p is Period.WEEK:
                iso = d.isocalendar()
                return (iso.year, iso.week)
            return (d.year, d.month)

        return label

    def _guess_start(self, t: int, tz: ZoneInfo) -> int:
        d = datetime.fromtimestamp(t, tz)
        if self.period is Period.HOUR:
            return _ts(d.replace(minute=0, second=0, microsecond=0))  # keeps the fold
        if self.period is Period.DAY:
            return _midnight(d.date(), tz)
        if self.period is Period.WEEK:
            return _midnight(d.date() - timedelta(days=d.weekday()), tz)
        return _midnight(d.date().replace(day=1), tz)

    def _guess_end(self, start: int, tz: ZoneInfo) -> int:
        if self.period is Period.HOUR:
            return start + 3600
        first = datetime.fromtimestamp(start, tz).date()
        if self.period is Period.DAY:
            return _midnight(first + timedelta(days=1), tz)
        if self.period is Period.WEEK:
            return _midnight(first + timedelta(days=7), tz)
        month = first.replace(day=1)
        return _midnight(date(month.year + month.month // 12, month.month % 12 + 1, 1), tz)

    # -- bounds checked against the labels, bisected where the guess was wrong --------------

    def _check_start(self, label: Callable[[int], Label], here: Label, guess: int, t: int) -> int:
        """The first second labelled `here` at or before `t`."""
        if guess <= t and label(guess) == here and label(guess - 1) != here:
            return guess
        lo, hi = t - _REACH_S[self.period], t  # label(lo) differs, label(hi) is here
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if label(mid) == here:
                hi = mid
            else:
                lo = mid
        return hi

    def _check_end(self, label: Callable[[int], Label], here: Label, guess: int, t: int) -> int:
        """The first second after `t` labelled otherwise."""
        if guess > t and label(guess) != here and label(guess - 1) == here:
            return guess
        lo, hi = t, t + _REACH_S[self.period]  # label(lo) is here, label(hi) differs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if label(mid) == here:
                lo = mid
            else:
                hi = mid
        return hi

    def _key(self, start: int, tz: ZoneInfo) -> str:
        d = datetime.fromtimestamp(start, tz)
        if self.period is Period.HOUR:
            return d.isoformat(timespec="minutes")  # the offset tells a repeated hour apart
        if self.period is Period.DAY:
            return d.date().isoformat()
        if self.period is Period.WEEK:
            iso = d.isocalendar()
            return f"{iso.year}-W{iso.week:02d}"  # the ISO year: 2025-12-29 is in 2026-W01
        return f"{d.year}-{d.month:02d}"


def _midnight(day: date, tz: ZoneInfo) -> int:
    """The start of local `day`. Where midnight is skipped (clocks spring forward at 00:00),
    fold=0 reads it at the offset before the change, which is the instant of the change:
    the first second of that day."""
    return _ts(datetime(day.year, day.month, day.day, tzinfo=tz))


def _ts(d: datetime) -> int:
    return math.floor(d.timestamp())
