"""baton/periods.py: budget periods on a time zone's wall clock, across daylight saving changes,
month ends and ISO weeks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from baton.periods import Calendar, Period, period, zone

H = 3600


def at(zone_name: str, *wall: int, fold: int = 0) -> float:
    """Unix seconds of a wall-clock time in a zone."""
    return datetime(*wall, tzinfo=ZoneInfo(zone_name), fold=fold).timestamp()  # type: ignore[arg-type, misc]


def utc(*wall: int) -> float:
    return datetime(*wall, tzinfo=UTC).timestamp()  # type: ignore[arg-type, misc]


@pytest.mark.parametrize(
    ("zone_name", "day", "hours"),
    [
        ("America/New_York", (2025, 3, 9), 23),  # spring forward: 02:00 -> 03:00
        ("America/New_York", (2025, 11, 2), 25),  # fall back: 02:00 -> 01:00
        ("America/New_York", (2025, 11, 3), 24),
        ("Europe/Berlin", (2025, 3, 30), 23),  # 02:00 CET -> 03:00 CEST
        ("Europe/Berlin", (2025, 10, 26), 25),  # 03:00 CEST -> 02:00 CET
        ("UTC", (2025, 3, 30), 24),
    ],
)
def test_a_day_is_its_wall_clock_day_23_24_or_25_hours(
    zone_name: str, day: tuple[int, int, int], hours: int
) -> None:
    cal = Calendar.of("day", zone_name)
    for wall_hour in (0, 12, 23):  # any instant of the day names the same span
        span = cal.span(at(zone_name, *day, wall_hour, 30))
        assert span.start == at(zone_name, *day)
        assert span.end - span.start == hours * H
        assert span.key == f"day:{zone_name}:{day[0]}-{day[1]:02d}-{day[2]:02d}"
    # Periods tile time: the next day starts where this one ends.
    assert cal.span(span.end).start == span.end
    assert cal.span(span.start - 1).end == span.start


def test_the_repeated_hour_of_a_fall_back_is_two_real_hours_not_one_long_one() -> None:
    cal = Calendar.of("hour", "America/New_York")
    first = cal.span(at("America/New_York", 2025, 11, 2, 1, 30, fold=0))  # 01:30 EDT
    second = cal.span(at("America/New_York", 2025, 11, 2, 1, 30, fold=1))  # 01:30 EST
    assert first.end - first.start == H and second.end - second.start == H
    assert first.end == second.start
    assert first.key == "hour:America/New_York:2025-11-02T01:00-04:00"
    assert second.key == "hour:America/New_York:2025-11-02T01:00-05:00"
    assert cal.span(second.end).key == "hour:America/New_York:2025-11-02T02:00-05:00"


def test_the_hour_skipped_in_spring_does_not_exist() -> None:
    cal = Calendar.of("hour", "Europe/Berlin")
    before = cal.span(at("Europe/Berlin", 2025, 3, 30, 1, 59))
    after = cal.span(before.end)
    assert before.end - before.start == H
    assert after.key == "hour:Europe/Berlin:2025-03-30T03:00+02:00"  # 02:00 never happened


def test_a_half_hour_daylight_saving_shift_still_tiles_time() -> None:
    """Lord Howe Island moves its clocks by 30 minutes: the wall clock's guess is wrong and
    the bounds are found by bisection."""
    cal = Calendar.of("hour", "Australia/Lord_Howe")
    t = utc(2025, 10, 4, 14, 30)  # 01:00 +10:30; at 02:00 the clocks go to 02:30 (+11)
    spans = [cal.span(t)]
    for _ in range(4):
        spans.append(cal.span(spans[-1].end))
    for a, b in zip(spans, spans[1:], strict=False):
        assert a.end == b.start and a.start < a.end <= a.start + H
    assert [s.end - s.start for s in spans[:3]] == [H, H // 2, H]
    back = cal.span(utc(2025, 4, 5, 14, 45))  # 01:45 +11, before the fall back at 02:00
    assert back.end == utc(2025, 4, 5, 15, 0)  # the 30 minutes repeated are a period of their own
    assert cal.span(back.end).end - back.end == H // 2


@pytest.mark.parametrize(
    ("t", "start", "end", "key"),
    [
        (utc(2025, 1, 31, 23, 59, 59), utc(2025, 1, 1), utc(2025, 2, 1), "2025-01"),
        (utc(2025, 2, 1), utc(2025, 2, 1), utc(2025, 3, 1), "2025-02"),  # 28 days
        (utc(2024, 2, 29, 12), utc(2024, 2, 1), utc(2024, 3, 1), "2024-02"),  # leap: 29
        (utc(2024, 12, 31, 23), utc(2024, 12, 1), utc(2025, 1, 1), "2024-12"),
    ],
)
def test_a_month_is_the_calendar_month(t: float, start: float, end: float, key: str) -> None:
    span = Calendar.of("month").span(t)
    assert (span.start, span.end, span.key) == (start, end, f"month:UTC:{key}")


def test_a_month_with_a_daylight_saving_change_is_an_hour_short() -> None:
    span = Calendar.of("month", "Europe/Berlin").span(at("Europe/Berlin", 2025, 3, 15))
    assert span.start == at("Europe/Berlin", 2025, 3, 1)
    assert span.end == at("Europe/Berlin", 2025, 4, 1)
    assert span.end - span.start == 31 * 24 * H - H


@pytest.mark.parametrize(
    ("day", "monday", "key"),
    [
        ((2025, 3, 9), (2025, 3, 3), "2025-W10"),  # a Sunday belongs to the week before
        ((2025, 3, 10), (2025, 3, 10), "2025-W11"),  # Monday starts one
        ((2025, 12, 31), (2025, 12, 29), "2026-W01"),  # the ISO year, not the calendar's
        ((2027, 1, 2), (2026, 12, 28), "2026-W53"),
    ],
)
def test_a_week_is_the_iso_week_from_monday(
    day: tuple[int, int, int], monday: tuple[int, int, int], key: str
) -> None:
    span = Calendar.of("week", "America/New_York").span(at("America/New_York", *day, 18))
    assert span.start == at("America/New_York", *monday)
    start = datetime(*monday, tzinfo=ZoneInfo("America/New_York"))
    assert span.end == (start + timedelta(days=7)).timestamp()  # wall-clock Monday, DST or not
    assert span.key == f"week:America/New_York:{key}"


def test_the_week_of_the_spring_change_is_an_hour_short() -> None:
    span = Calendar.of("week", "America/New_York").span(at("America/New_York", 2025, 3, 9, 12))
    assert span.end - span.start == 7 * 24 * H - H


def test_the_same_instant_has_each_zones_own_day() -> None:
    t = utc(2025, 6, 1, 2)  # still May 31 in New York
    assert Calendar.of("day").span(t).key == "day:UTC:2025-06-01"
    assert Calendar.of("day", "America/New_York").span(t).key == "day:America/New_York:2025-05-31"
    assert Calendar.of("month", "America/New_York").span(t).key.endswith(":2025-05")


def test_utc_is_the_default_and_periods_name_themselves() -> None:
    assert Calendar.of("day") == Calendar(Period.DAY, "UTC")
    assert Calendar.of("hour", "Asia/Kolkata").name == "hour:Asia/Kolkata"
    # A half-hour offset: hours start at :30 UTC.
    span = Calendar.of("hour", "Asia/Kolkata").span(utc(2025, 1, 1, 0, 10))
    assert span.start == utc(2024, 12, 31, 23, 30) and span.end == utc(2025, 1, 1, 0, 30)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: period("fortnight"), "unknown period 'fortnight': one of hour, day, week, month"),
        (lambda: Calendar.of("Day"), "unknown period 'Day'"),
        (lambda: Calendar.of("day", "Mars/Olympus"), "unknown time zone 'Mars/Olympus'"),
        (lambda: Calendar.of("day", ""), "a time zone is an IANA name"),
        (lambda: Calendar.of("day", "../../etc/passwd"), "unknown time zone"),
        (lambda: zone("Europe/Nowhere"), "unknown time zone 'Europe/Nowhere'"),
    ],
)
def test_bad_periods_and_zones_are_refused_by_name(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        make()  # type: ignore[operator]
