from __future__ import annotations

import math
from typing import Any

import pytest

from bench import overhead_table as ot


def run(
    target: str, mode: str, conc: int, *, done: int, p50: float = 1.0, ttft: float | None = None,
    cpu: dict[str, float] | None = None, parts: tuple[str, ...] = (), events: int = 0,
    errors: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """A `bench.loadgen` result over a 2 s window, as bench.overhead records it."""
    return {
        "target": target, "mode": mode, "concurrency": conc, "window_s": 2.0,
        "ok_in_window": done, "events_in_window": events, "latency_ms": [p50],
        "ttft_ms": [p50 if ttft is None else ttft], "errors": errors,
        "cpu_s": {"e0": 0.5, "loadgen": 0.5, **(cpu or {})}, "router_parts": list(parts),
    }  # fmt: skip


def full(
    target: str, *, p50: float, ttft: float, rps16: float, rps64: float, cpu: dict[str, float],
    cpu_stream: dict[str, float] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every cell of one target, over 2 s windows (so `done` is twice the requests/s), with
    10,000 events on the c=64 streams."""
    parts = tuple(cpu)
    return [
        run(target, "nonstream", 1, done=100, p50=p50, cpu=cpu, parts=parts),
        run(target, "nonstream", 16, done=int(rps16 * 2), cpu=cpu, parts=parts),
        run(target, "nonstream", 64, done=int(rps64 * 2), cpu=cpu, parts=parts),
        run(target, "stream", 1, done=10, ttft=ttft, cpu=cpu, parts=parts, events=650),
        run(target, "stream", 64, done=150, cpu=cpu_stream or cpu, parts=parts, events=10_000),
    ]


def table(baton_cpu: dict[str, float], baton_rps64: float = 400.0) -> list[ot.Row]:
    runs = [
        *full("direct", p50=1.0, ttft=2.0, rps16=1000, rps64=500, cpu={}),
        *full("Baton", p50=4.0, ttft=5.0, rps16=600, rps64=baton_rps64, cpu=baton_cpu),
        *full("aiohttp floor", p50=3.0, ttft=4.0, rps16=800, rps64=400, cpu={"floor": 0.5}),
    ]
    return ot.rows(runs)


def test_direct_row_is_absolute_and_router_rows_are_relative_to_it() -> None:
    direct, baton, floor = table({"shim": 0.5, "control": 0.25})
    assert (direct.p50_ms, direct.rps_16, direct.rps_64, direct.ttft_ms) == (1.0, 1000, 500, 2.0)
    assert math.isnan(direct.cpu_us_per_req) and math.isnan(direct.router_core_busy)
    assert (floor.p50_ms, floor.ttft_ms) == (2.0, 2.0)  # added over direct's
    assert (floor.rps_16, floor.rps_64) == (0.8, 0.8)  # ratios to direct's
    assert floor.cpu_us_per_req == pytest.approx(0.5e6 / 800)  # 0.5 s, 800 requests


def test_router_cpu_sums_its_processes_and_keeps_each_apart() -> None:
    _, baton, floor = table({"shim": 0.5, "control": 0.25})
    # 0.75 s over the 800 requests of the c=64 window; 0.75 s over 10,000 events.
    assert baton.cpu_us_per_req == pytest.approx(0.75e6 / 800)
    assert dict(baton.cpu_us_per_req_by_part) == pytest.approx(
        {"shim": 0.5e6 / 800, "control": 0.25e6 / 800}
    )
    assert baton.cpu_us_per_event == pytest.approx(75.0)
    assert dict(baton.cpu_us_per_event_by_part) == pytest.approx({"shim": 50.0, "control": 25.0})
    assert floor.cpu_us_per_req_by_part == {}  # one process: no lines under it
    # The engine core: the engine and the load generator, 1 s of CPU in the 2 s window.
    assert (baton.engine_core_busy, baton.router_core_busy) == (0.5, 0.375)


def test_medians_over_reps_not_means() -> None:
    runs = [
        *full("direct", p50=1.0, ttft=1.0, rps16=100, rps64=100, cpu={}),
        *full("direct", p50=1.2, ttft=1.0, rps16=100, rps64=100, cpu={}),
        *full("direct", p50=9.0, ttft=1.0, rps16=100, rps64=100, cpu={}),
    ]
    (direct,) = ot.rows(runs)
    assert direct.p50_ms == 1.2


def test_checks_state_baton_over_the_floor() -> None:
    rows = table({"shim": 0.5, "control": 0.25})
    got = {t.name: (t.value, t.verdict) for t in ot.checks(rows)}
    assert got["Baton/floor CPU per request, c=64"] == (pytest.approx(1.5), "PASS")
    assert got["Baton/floor CPU per request, shim alone, c=64"] == (pytest.approx(1.0), "PASS")
    assert got["Baton/floor added p50, c=1"] == (pytest.approx(1.5), "PASS")
    assert got["Baton/floor added TTFT, stream, c=1"] == (pytest.approx(1.5), "PASS")
    assert got["Baton/floor rps ratio, c=16"] == (pytest.approx(0.75), "FAIL")
    assert got["Baton/floor rps ratio, c=64"] == (pytest.approx(1.0), "PASS")
    assert got["Baton/floor CPU per SSE event, c=64"] == (pytest.approx(1.5), "PASS")


def test_checks_fail_past_the_limits_and_skip_what_did_not_run() -> None:
    rows = table({"shim": 1.0, "control": 0.5}, baton_rps64=300)
    verdicts = {t.name: t.verdict for t in ot.checks(rows)}
    assert verdicts["Baton/floor CPU per request, c=64"] == "FAIL"
    assert verdicts["Baton/floor CPU per request, shim alone, c=64"] == "FAIL"
    assert verdicts["Baton/floor rps ratio, c=64"] == "FAIL"
    without_floor = [r for r in rows if r.target != ot.FLOOR]
    assert {t.verdict for t in ot.checks(without_floor)} == {"SKIP"}


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [(3.0, 2.0, 1.5), (1.0, 0.0, math.nan), (1.0, -1.0, math.nan), (math.nan, 2.0, math.nan)],
)
def test_ratio_is_nan_against_nothing(a: float, b: float, want: float) -> None:
    got = ot.ratio(a, b)
    assert (math.isnan(got) and math.isnan(want)) or got == want


def test_render_has_a_line_per_process_and_per_target_not_run() -> None:
    text = ot.render(table({"shim": 0.5, "control": 0.25}), {"vllm-router 0.1.17": "exited 1"})
    lines = text.splitlines()
    assert lines[0].split()[0] == "target"
    assert lines[2].startswith("direct (one engine)")
    assert lines[3].startswith("Baton ")
    assert {lines[4].split()[0], lines[5].split()[0]} == {"shim", "control"}
    assert lines[6].startswith("aiohttp floor")
    assert "vllm-router 0.1.17  not run: exited 1" in lines
    assert sum(line.startswith(("PASS", "FAIL", "SKIP")) for line in lines) == 7


def test_baton_is_stated_over_the_floor_that_asks_a_decider_when_it_ran() -> None:
    rows = table({"shim": 1.0, "control": 0.5})
    assert ot.decided_lines(rows) == []  # not run: nothing said
    baton = next(r for r in rows if r.target == ot.BATON)
    decided = ot.Row(ot.DECIDED, baton.p50_ms / 2, baton.rps_16, baton.rps_64 * 2, baton.ttft_ms,
                     baton.cpu_us_per_req / 1.25, baton.cpu_us_per_event, 0)  # fmt: skip
    (_, line) = ot.decided_lines([*rows, decided])
    assert "CPU per request 1.25x" in line and "added p50 c=1 2.00x" in line
    assert "rps ratio c=64 0.50x" in line and "CPU per SSE event 1.00x" in line
    assert line in ot.render([*rows, decided], {})
