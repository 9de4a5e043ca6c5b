from __future__ import annotations

import math
from dataclasses import replace

import pytest

from bench import affinity, stats
from bench.affinity import Plan, Rep, Turn

SMALL = Plan(conversations=3, turns=2, system_words=5, chunk_words=4, burst=4, burst_words=6)


def rep(policy: str, p50: float, burst: float, **kw: object) -> Rep:
    fields: dict[str, object] = {
        "rep": 0, "ttft_p50_ms": p50, "ttft_p90_ms": 2 * p50, "hit_ratio": 0.5, "moved": 0.0,
        "burst_s": burst, "burst_max_share": 0.5, "reasons": {}, **kw,
    }  # fmt: skip
    return Rep(policy, **fields)  # type: ignore[arg-type]


def test_workload_is_a_function_of_the_seed() -> None:
    a, b = affinity.make_workload(SMALL, 1), affinity.make_workload(SMALL, 1)
    assert a == b
    assert a != affinity.make_workload(SMALL, 2)
    assert [len(c) for c in a.chunks] == [2, 2, 2]
    # Tool time only between turns, within [0, tool_ms); seeded, so conversations drift apart.
    assert [t[0] for t in a.tool_s] == [0.0] * 3
    assert all(0 <= t[1] < SMALL.tool_ms / 1e3 for t in a.tool_s)
    assert len({t[1] for t in a.tool_s}) == 3
    assert len(a.burst_users) == 4 and len(set(a.burst_users)) == 4
    assert a.burst_system not in a.agent_systems  # the burst starts cold after the agent loop


@pytest.mark.parametrize(("shared", "distinct"), [(True, 1), (False, 3)])
def test_system_prompt_shared_or_one_per_conversation(shared: bool, distinct: int) -> None:
    wl = affinity.make_workload(replace(SMALL, shared_system=shared), 0)
    assert len(wl.agent_systems) == 3
    assert len(set(wl.agent_systems)) == distinct


@pytest.mark.parametrize(
    ("chunks", "replies", "roles"),
    [
        (["a"], [], ["system", "user"]),
        (["a", "b"], ["r1"], ["system", "user", "assistant", "user"]),
        (["a", "b", "c"], ["r1", "r2"], ["system", *["user", "assistant"] * 2, "user"]),
    ],
)
def test_each_turn_resends_the_history_with_replies_verbatim(
    chunks: list[str], replies: list[str], roles: list[str]
) -> None:
    msgs = affinity.turn_messages("sys", chunks, replies)
    assert [m["role"] for m in msgs] == roles
    assert msgs[0]["content"] == "sys"
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == replies
    assert [m["content"].rsplit("\n", 1)[1] for m in msgs if m["role"] == "user"] == chunks


def turns(*backends_per_conv: str) -> list[Turn]:
    """Conversation i's turns on the backends spelled by string i, e.g. "aab"."""
    return [
        Turn(c, t + 1, 0.1 * (t + 1), f"r{c}.{t}", backend=b)
        for c, s in enumerate(backends_per_conv)
        for t, b in enumerate(s)
    ]


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        (turns("aaaa"), 0.0),
        (turns("abab"), 1.0),  # round robin in lockstep: every warm turn moved
        (turns("aabb", "bbbb"), 1 / 6),
        (turns("a"), math.nan),  # no warm turn
    ],
)
def test_moved_fraction_counts_warm_turns_off_the_previous_backend(
    records: list[Turn], expected: float
) -> None:
    got = affinity.moved_fraction(records)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def test_rep_result_takes_warm_turns_cache_deltas_and_burst_placement() -> None:
    records = [
        replace(t, reason="spread" if t.turn == 1 else "pin-hit") for t in turns("aaa", "bbb")
    ]
    got = affinity.rep_result(
        "adaptive", 1, records, (300.0, 400.0), 2.5, ["s0", "s0", "s0", "s1"], ["spread"] * 4
    )
    # Warm TTFTs: 200, 300 ms per conversation -> p50 250, p90 300.
    assert (got.ttft_p50_ms, got.ttft_p90_ms) == pytest.approx((250.0, 300.0))
    assert (got.hit_ratio, got.moved, got.burst_s, got.burst_max_share) == (0.75, 0.0, 2.5, 0.75)
    assert got.reasons == {"agent": {"spread": 2, "pin-hit": 4}, "burst": {"spread": 4}}


def test_summary_takes_medians_per_policy_and_sums_reasons() -> None:
    reps = [
        rep("rr", 100, 3.0, reasons={"agent": {"spread": 4}}),
        rep("ad", 50, 2.0, reasons={"agent": {"pin-hit": 3, "spill": 1}}),
        rep("rr", 300, 5.0, reasons={"agent": {"spread": 4}}),
        rep("rr", 200, 4.0, reasons={"agent": {"spread": 4}, "burst": {"spread": 2}}),
    ]
    got = affinity.summarize(reps)
    assert list(got) == ["rr", "ad"]
    assert (got["rr"].ttft_p50_ms, got["rr"].burst_s, got["rr"].rep) == (200.0, 4.0, -1)
    assert got["rr"].reasons == {"agent": {"spread": 12}, "burst": {"spread": 2}}
    assert got["ad"].reasons == {"agent": {"pin-hit": 3, "spill": 1}, "burst": {}}


@pytest.mark.parametrize(
    ("agent_p50", "burst_s", "verdicts"),
    [
        # (roundrobin, affinity, adaptive)
        ((300, 110, 100), (3.0, 6.0, 3.1), ["PASS", "PASS", "PASS", "PASS"]),
        ((300, 100, 106), (3.0, 6.0, 3.0), ["FAIL", "PASS", "PASS", "PASS"]),
        ((100, 100, 100), (3.0, 3.0, 3.2), ["PASS", "FAIL", "FAIL", "FAIL"]),
    ],
)
def test_targets_compare_adaptive_and_the_pattern_with_the_best_policy(
    agent_p50: tuple[float, ...], burst_s: tuple[float, ...], verdicts: list[str]
) -> None:
    summary = {
        p: rep(p, a, b) for p, a, b in zip(affinity.POLICIES, agent_p50, burst_s, strict=True)
    }
    assert [t.verdict for t in affinity.targets(summary)] == verdicts


def test_targets_skip_when_a_policy_was_not_run() -> None:
    got = affinity.targets({"roundrobin": rep("roundrobin", 100, 3.0)})
    assert [t.verdict for t in got] == ["SKIP"] * 4


def test_tables_show_ratios_to_the_best_and_reason_counts() -> None:
    summary = {
        "roundrobin": rep("roundrobin", 200, 3.0, reasons={"agent": {"spread": 8}}),
        "adaptive": rep("adaptive", 100, 3.3, reasons={"agent": {"pin-hit": 6, "x": 1}}),
    }
    lines = affinity.table(summary).splitlines()
    assert lines[2].split() == ["roundrobin", "200.0", "400.0", "2.00", "50.0", "0", "3.00",
                                "1.00", "50"]  # fmt: skip
    assert lines[3].split()[3] == "1.00" and lines[3].split()[7] == "1.10"
    reasons = affinity.reason_table(summary).splitlines()
    assert reasons[2].split() == ["roundrobin", "agent", "8", "0", "0", "0", "0"]
    assert reasons[3].split() == ["adaptive", "agent", "0", "6", "0", "0", "1"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"a": 2.0, "b": 1.0}, {"a": 2.0, "b": 1.0}),
        ({"a": 2.0, "b": math.nan}, {"a": 1.0, "b": math.nan}),  # unmeasured is never best
        ({"a": 0.0, "b": 1.0}, {"a": math.nan, "b": math.nan}),
    ],
)
def test_ratio_to_best(values: dict[str, float], expected: dict[str, float]) -> None:
    got = stats.ratio_to_best(values)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert (math.isnan(got[k]) and math.isnan(v)) or got[k] == v


METRICS = """# HELP vllm:prefix_cache_hits_total x
vllm:prefix_cache_hits_total{engine="0",model_name="toy"} 30.0
vllm:prefix_cache_hits_total{engine="1",model_name="toy"} 12.0
vllm:prefix_cache_hits_created{engine="0",model_name="toy"} 1.7e+09
vllm:prefix_cache_queries_total 50
"""


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vllm:prefix_cache_hits_total", 42.0),  # summed over label sets, _created ignored
        ("vllm:prefix_cache_queries_total", 50.0),  # no labels
        ("vllm:prefix_cache_hits", math.nan),  # a prefix of a name is not the name
    ],
)
def test_metric_sum(name: str, expected: float) -> None:
    got = stats.metric_sum(METRICS, name)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


@pytest.mark.parametrize(
    ("k", "expected"),
    [(0, ["a", "b", "c"]), (1, ["b", "c", "a"]), (4, ["b", "c", "a"])],
)
def test_rotated(k: int, expected: list[str]) -> None:
    assert stats.rotated(["a", "b", "c"], k) == expected
    assert stats.rotated([], k) == []


@pytest.mark.parametrize(
    ("values", "expected"), [([], 0.0), (["s0"] * 4, 1.0), (["s0", "s1", "s0", "s2"], 0.5)]
)
def test_largest_share(values: list[str], expected: float) -> None:
    assert stats.largest_share(values) == expected
