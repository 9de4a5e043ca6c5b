from __future__ import annotations

import math
from typing import Any

import pytest

from bench import stats


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([5.0], 50, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # between the two middle ranks
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([4.0, 1.0, 3.0, 2.0], 50, 2.5),  # order of arrival does not matter
        ([float(i) for i in range(1, 101)], 99, 99.01),  # numpy: percentile(1..100, 99)
        ([10.0, 20.0], 25, 12.5),
    ],
)
def test_percentile_interpolates_like_numpy(values: list[float], q: float, expected: float) -> None:
    assert stats.percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan_and_bad_q_raises() -> None:
    assert math.isnan(stats.percentile([], 50))
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


@pytest.mark.parametrize(
    ("values", "expected"),
    [([3.0, 1.0, 2.0], 2.0), ([1.0, float("nan"), 3.0], 2.0), ([float("nan")], math.nan)],
)
def test_median_ignores_nan(values: list[float], expected: float) -> None:
    got = stats.median(values)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def raw(
    target: str, mode: str, conc: int, *, lat: list[float], done: int, **kw: Any
) -> dict[str, Any]:
    return {
        "target": target,
        "mode": mode,
        "concurrency": conc,
        "window_s": 2.0,
        "ok_in_window": done,
        "latency_ms": lat,
        "ttft_ms": kw.get("ttft", lat),
        "errors": kw.get("errors", 0),
        "cpu_s": kw.get("cpu", {}),
    }


def test_run_stats_rates_and_cpu_per_request() -> None:
    s = stats.run_stats(
        raw("baton", "nonstream", 1, lat=[1.0, 2.0, 3.0], done=400, cpu={"shim": 0.2})
    )
    assert s.rps == 200.0
    assert s.p50_ms == 2.0
    assert s.cpu_us_per_req["shim"] == pytest.approx(500.0)  # 0.2 s / 400 requests
    assert s.cpu_util["shim"] == pytest.approx(0.1)  # 0.2 s over a 2 s window


def test_summarize_takes_median_over_reps_and_sums_errors() -> None:
    runs = [
        raw("direct", "stream", 1, lat=[1.0], ttft=[0.5], done=100),
        raw("baton", "stream", 1, lat=[3.0], ttft=[1.5], done=50, errors=1),
        raw("baton", "stream", 1, lat=[2.0], ttft=[1.0], done=40, errors=2),
        raw("direct", "stream", 1, lat=[1.2], ttft=[0.7], done=120),
        raw("baton", "stream", 1, lat=[9.0], ttft=[4.0], done=60),
        raw("direct", "stream", 1, lat=[0.8], ttft=[0.6], done=80),
    ]
    (cell,) = stats.summarize(runs)
    assert (cell.direct.p50_ms, cell.baton.p50_ms) == (1.0, 3.0)  # middle rep, not the 9 ms one
    assert cell.added_p50_ms == pytest.approx(2.0)
    assert cell.added_ttft_p50_ms == pytest.approx(1.5 - 0.6)
    assert cell.ratio == pytest.approx(25.0 / 50.0)  # median 50 vs 100 requests in 2 s
    assert (cell.direct.errors, cell.baton.errors) == (0, 3)


def test_run_stats_cpu_per_sse_event() -> None:
    run = {**raw("floor", "stream", 64, lat=[5.0], done=10, cpu={"floor": 0.013}),
           "events_in_window": 650}  # fmt: skip
    s = stats.run_stats(run)
    assert s.events == 650
    assert s.cpu_us_per_event["floor"] == pytest.approx(20.0)  # 13 ms / 650 events
    assert math.isnan(stats.run_stats(raw("d", "stream", 1, lat=[1.0], done=0, cpu={"x": 1.0}))
                      .cpu_us_per_event["x"])  # fmt: skip


@pytest.mark.parametrize(
    ("value", "limit", "higher", "verdict"),
    [(1.2, 1.5, False, "PASS"), (1.6, 1.5, False, "FAIL"), (0.9, 0.8, True, "PASS"),
     (0.7, 0.8, True, "FAIL"), (math.nan, 1.5, False, "SKIP")],
)  # fmt: skip
def test_target_verdicts(value: float, limit: float, higher: bool, verdict: str) -> None:
    assert stats.Target("t", value, limit, higher).verdict == verdict


def test_render_table_aligns_columns() -> None:
    text = stats.render_table(["name", "n"], [["a", "10"], ["bbb", "2"]])
    assert text.splitlines() == ["name   n", "----  --", "a     10", "bbb    2"]
