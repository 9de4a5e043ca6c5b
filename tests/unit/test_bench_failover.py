from __future__ import annotations

import math
import tomllib
from types import SimpleNamespace
from typing import Any

import pytest

from bench import chaos_fleet as cf
from bench import failover as fo
from bench.chaos_fleet import StreamRecord


def test_chaos_schedule_is_a_function_of_the_seed_and_stays_in_its_bounds() -> None:
    a = cf.chaos_schedule(7, kill_every=0.4, count=50)
    assert a == cf.chaos_schedule(7, kill_every=0.4, count=50)
    assert a != cf.chaos_schedule(8, kill_every=0.4, count=50)
    assert len(a) == 50
    gaps = [k.at - prev for prev, k in zip([0.0] + [k.at for k in a], a, strict=False)]
    assert all(0.2 - 1e-6 <= g <= 0.6 + 1e-6 for g in gaps)
    assert all(0.1 <= k.restart_after <= 0.5 and 0 <= k.draw < 1 for k in a)


@pytest.mark.parametrize(
    ("up_since", "expected"),
    [
        ({"s0": 0.0, "s1": 0.0, "s2": 0.0}, ["s0", "s1", "s2"]),  # all settled: any
        ({"s0": None, "s1": 0.0, "s2": 0.0}, ["s1", "s2"]),  # the dead one is no victim
        ({"s0": None, "s1": 0.0, "s2": 9.8}, ["s2"]),  # s1 is the only settled one: spared
        ({"s0": None, "s1": 0.0, "s2": None}, []),  # never leave no backend
        ({"s0": 9.9, "s1": 9.8}, []),  # nobody settled yet: a resume would have nowhere to go
    ],
)
def test_eligible_victims_always_leave_a_settled_backend(
    up_since: dict[str, float | None], expected: list[str]
) -> None:
    assert cf.eligible(up_since, now=10.0, settle=0.6) == expected


@pytest.mark.parametrize(
    ("draw", "expected"), [(0.0, "a"), (0.34, "b"), (0.67, "c"), (0.999999, "c")]
)
def test_pick_maps_the_draw_onto_the_candidates(draw: float, expected: str) -> None:
    assert cf.pick(draw, ["a", "b", "c"]) == expected
    assert cf.pick(draw, []) is None


def test_control_toml_lists_every_sim() -> None:
    sims: Any = {"s0": SimpleNamespace(ready="http://127.0.0.1:1"),
                 "s1": SimpleNamespace(ready="http://127.0.0.1:2")}  # fmt: skip
    doc = tomllib.loads(cf.fleet_toml(sims))
    assert doc["probes"]["interval"] == cf.PROBE_INTERVAL
    assert [(b["id"], b["url"], b["kind"]) for b in doc["backends"]] == [
        ("s0", "http://127.0.0.1:1", "vllm"),
        ("s1", "http://127.0.0.1:2", "vllm"),
    ]


def test_busy_fraction() -> None:
    assert cf.busy_fraction((100, 1000), (150, 1200)) == 0.25
    assert math.isnan(cf.busy_fraction((1, 1), (1, 1)))


@pytest.mark.parametrize(
    ("status", "done", "error", "verdict"),
    [
        (200, True, "", "completed"),
        (200, False, "", "truncated"),  # no [DONE]: a silent truncation
        (200, True, '{"error": {"message": "x"}}', "failed"),  # an error event, even with [DONE]
        (503, False, "busy", "failed"),
        (0, False, "ClientConnectionError: reset", "failed"),
    ],
)
def test_stream_verdict(status: int, done: bool, error: str, verdict: str) -> None:
    assert StreamRecord(0, status=status, done=done, error=error).verdict == verdict


def record(
    rid: str, text: str, *, prompt: int = 0, start: float = 100.0,
    arrivals: tuple[float, ...] = (0.01, 0.02), done: bool = True, error: str = "",
) -> StreamRecord:  # fmt: skip
    return StreamRecord(prompt, rid, 200, text, done, error, start, start + 1.0, list(arrivals))


REFS = [fo.Reference("p0", (1, 2), (3, 4), "hello world"), fo.Reference("p1", (5,), (6,), "abc")]


def event(rid: str, **kw: Any) -> dict[str, Any]:
    return {"request_id": rid, "from_backend": "s0", "to_backend": "s1", "failure": "disconnect",
            "tokens_sent": 1, "seam": "verified", "gap_ms": 4.0, "attempt": 1,
            "outcome": "resumed", **kw}  # fmt: skip


def test_summarize_counts_verdicts_identity_and_failovers() -> None:
    records = [
        record("a", "hello world"),
        record("b", "hello wOrld"),  # completed but not byte-identical
        record("c", "abc", prompt=1),
        record("d", "hel", done=False),  # truncated
        record("e", "he", error='{"error": {"message": "backend s0 failed"}}'),
    ]
    events = [
        event("a", gap_ms=4.0),
        event("b", gap_ms=8.0, seam="divergent"),
        event("e", outcome="failed", gap_ms=0.0, failure="stall", seam=""),
        event("e", outcome="exhausted", gap_ms=0.0, seam=""),
    ]
    s = fo.summarize(records, REFS, events, floors_ms=[2.0, 4.0, 6.0], kills=[(0.0, "s0")])
    assert (s["requests"], s["completed"], s["failed"], s["truncated"]) == (5, 3, 1, 1)
    assert s["identical_pct"] == pytest.approx(200 / 3)
    assert s["non_identical"] == [
        {"rid": "b", "prompt": 0, "at_char": 7, "got": "hello wOrld", "want": "hello world"}
    ]
    assert s["by_outcome"] == {"resumed": 2, "failed": 1, "exhausted": 1}
    assert s["by_seam"] == {"verified": 1, "divergent": 1, "-": 2}
    assert s["by_failure"] == {"disconnect": 3, "stall": 1}
    assert s["gap_ms"]["p50"] == 6.0  # resumed events only: a failed try has no gap
    assert s["floor_ms"]["p50"] == 4.0 and s["floor_samples"] == 3
    assert s["gap_over_floor"] == 1.5
    assert s["kills"] == 1
    assert [(b["rid"], b["verdict"], len(b["failovers"])) for b in s["bad_streams"]] == [
        ("d", "truncated", 0),
        ("e", "failed", 2),
    ]


def test_summarize_of_nothing_is_nan_not_a_crash() -> None:
    s = fo.summarize([], REFS, [], [], [])
    assert math.isnan(s["identical_pct"]) and math.isnan(s["gap_over_floor"])
    targets = {t.name: t.verdict for t in fo.targets(s)}
    assert list(targets.values()) == ["PASS", "SKIP", "SKIP", "SKIP", "SKIP"]


def test_seam_timing_measures_at_the_first_resumed_token() -> None:
    # Tokens 0-1 from s0, killed at t=100.025; token 2 (the first resumed) arrives at 100.034.
    r = record("a", "xyz", arrivals=(0.010, 0.020, 0.034, 0.040))
    kills = [(90.0, "s0"), (100.025, "s0"), (100.030, "s1"), (100.5, "s0")]
    got = fo.seam_timing([r], [event("a", tokens_sent=2)], kills)
    assert got["seam_stall_ms"]["p50"] == pytest.approx(14.0)
    assert got["kill_to_resume_ms"]["p50"] == pytest.approx(9.0)  # latest kill of s0 before


def test_seam_timing_skips_failed_tries_and_kills_out_of_the_window() -> None:
    r = record("a", "xy", arrivals=(0.01, 0.02))
    events = [event("a", tokens_sent=1, outcome="failed"), event("a", tokens_sent=0)]
    got = fo.seam_timing([r], events, kills=[(98.0, "s0")], window_s=1.0)
    assert math.isnan(got["seam_stall_ms"]["p50"])  # no token before a seam at 0
    assert math.isnan(got["kill_to_resume_ms"]["p50"])  # the kill was 2 s earlier


def test_overhead_compares_completed_streams_only() -> None:
    direct = [record("", "x", arrivals=(0.002,)), record("", "x", arrivals=(0.004,))]
    baton = [record("", "x", arrivals=(0.005,)), record("", "x", done=False)]
    o = fo.overhead(direct, baton)
    assert o["direct"]["ttft_p50"] == pytest.approx(3.0)
    assert o["baton"]["ttft_p50"] == pytest.approx(5.0)
    assert o["direct"]["total_p50"] == pytest.approx(1000.0)
    assert (o["direct"]["errors"], o["baton"]["errors"]) == (0, 1)


@pytest.mark.parametrize(
    ("failed", "truncated", "identical", "ratio", "verdicts"),
    [
        (0, 0, 100.0, 1.5, ["PASS", "PASS", "PASS", "PASS", "PASS"]),
        (1, 0, 100.0, 1.51, ["FAIL", "PASS", "FAIL", "PASS", "PASS"]),
        (0, 2, 99.5, 0.9, ["FAIL", "FAIL", "PASS", "PASS", "PASS"]),
    ],
)
def test_targets(
    failed: int, truncated: int, identical: float, ratio: float, verdicts: list[str]
) -> None:
    s = {"failed": failed, "truncated": truncated, "identical_pct": identical,
         "gap_over_floor": ratio, "gap_over_floor_together": 1.0,
         "gap_over_floor_loaded": 1.2}  # fmt: skip
    assert [t.verdict for t in fo.targets(s)] == verdicts


def test_report_prints_the_table_and_one_line_per_target() -> None:
    s = fo.summarize([record("a", "hello world")], REFS, [event("a")], [2.0], [(100.0, "s0")])
    side = {"ttft_p50": 1.0, "total_p50": 2.0, "errors": 0}
    text = fo.report(s, {"direct": side, "baton": side}, {"chaos": 0.5})
    assert "1/0/0 of 1" in text and "gap p50 / floor p50" in text
    verdicts = [ln.split()[0] for ln in text.splitlines()[-5:]]
    assert verdicts == ["PASS", "PASS", "FAIL", "SKIP", "SKIP"]


def test_kill_groups_gather_the_resumes_of_one_kill_on_one_card() -> None:
    def ev(t: float, to: str, outcome: str = "resumed") -> dict[str, object]:
        return {"time": t, "to_backend": to, "outcome": outcome}

    events = [ev(1.00, "s0"), ev(1.01, "s0"), ev(1.02, "s1"), ev(1.03, "s1"),
              ev(1.20, "s1"), ev(1.21, "s1", "failed")]  # fmt: skip
    groups = fo.kill_groups(events)
    assert [[e["time"] for e in g] for g in groups] == [[1.00, 1.01], [1.02, 1.03], [1.20]]


def test_prompts_are_deterministic_and_short() -> None:
    a = fo.make_prompts(3, 16)
    assert a == fo.make_prompts(3, 16) and a != fo.make_prompts(4, 16)
    assert all(3 <= len(p.split()) <= 6 for p in a)


def test_generic_stats_helpers() -> None:
    from bench import stats

    assert stats.p50_p99([1.0, 2.0, 3.0]) == {"p50": 2.0, "p99": pytest.approx(2.98)}
    lines = stats.target_lines(
        [stats.Target("gap", 2.0, 1.5), stats.Target("ok %", 100.0, 100, True),
         stats.Target("n", stats.NAN, 0)]
    )  # fmt: skip
    assert lines == [
        "FAIL  gap: 2.000 (<= 1.5)",
        "PASS  ok %: 100.000 (>= 100)",
        "SKIP  n: - (<= 0)",
    ]
    nan = stats.NAN
    assert stats.finite({"a": [1.0, nan], "b": (nan,)}) == {"a": [1.0, None], "b": [None]}


def test_engine_floor_matches_each_resume_by_its_exact_prompt_on_its_new_backend() -> None:
    from sim.timing import prompt_key

    rids = {"a": record("a", "hello world"), "b": record("b", "abc", prompt=1)}
    events = [
        event("a", tokens_sent=1, gap_ms=6.0),  # resumed p0 + [3] on s1
        event("b", tokens_sent=1, gap_ms=9.0, to_backend="s2"),  # not in s2's log: skipped
        event("a", outcome="failed", gap_ms=1.0),
    ]
    logs = {
        "s1": [{"prompt": prompt_key([1, 2, 3]), "ttft_ms": 4.0},
               {"prompt": prompt_key([1, 2]), "ttft_ms": 0.5}],  # the first request, not a resume
        "s2": [{"prompt": prompt_key([5, 6, 7]), "ttft_ms": 1.0}],
    }  # fmt: skip
    pairs = fo.engine_ttfts(events, rids, REFS, logs)
    assert pairs == [(6.0, 4.0)]
    s = fo.engine_floor(pairs)
    assert s["gap_over_engine_floor"] == pytest.approx(1.5) and s["engine_floor_samples"] == 1
    assert s["baton_added_ms"]["p50"] == pytest.approx(2.0)
