from __future__ import annotations

import math

import pytest

from bench import speculative as sp


def test_expected_tokens_per_round_is_the_capped_geometric_sum() -> None:
    assert sp.expected_tokens_per_round(0.0, 8) == 1.0  # only the target's own token
    assert sp.expected_tokens_per_round(1.0, 4) == 5.0  # every draft token plus the bonus
    assert sp.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    p, k = 0.7, 4
    assert sp.expected_tokens_per_round(p, k) == pytest.approx((1 - p ** (k + 1)) / (1 - p))
    with pytest.raises(ValueError):
        sp.expected_tokens_per_round(1.5, 2)


def test_ideal_speedup_charges_k_minus_one_draft_steps_and_one_target_step() -> None:
    # A free draft: the speedup is the tokens per round.
    assert sp.ideal_speedup(0.9, 4, 1e12) == pytest.approx(sp.expected_tokens_per_round(0.9, 4))
    # A draft as slow as the target at k=2: 1 draft step + 1 target step per round.
    assert sp.ideal_speedup(1.0, 2, 1.0) == pytest.approx(3 / 2)
    assert sp.ideal_speedup(0.0, 8, 8.0) < 1  # a useless draft only costs
    with pytest.raises(ValueError):
        sp.ideal_speedup(0.5, 2, 0)


def test_gate_intervals_pair_each_repair_with_the_next_verdict_of_its_pair() -> None:
    events = [
        {"time": 10.0, "action": "repair", "pair": "d", "target": "t1", "previous": "t0"},
        {"time": 10.01, "action": "repair", "pair": "e", "target": "t1"},
        {"time": 10.02, "action": "bind", "pair": "d"},
        {"time": 10.05, "action": "accept", "pair": "d", "observed": 0.5, "baseline": 0.6},
        {"time": 11.0, "action": "repair", "pair": "d", "target": "t0"},
        {"time": 11.1, "action": "reject", "pair": "d"},
    ]
    got = sp.gate_intervals(list(reversed(events)))  # order of arrival does not matter
    assert [(g["pair"], g["target"], g["verdict"]) for g in got] == [
        ("d", "t1", "accept"), ("e", "t1", None), ("d", "t0", "reject"),
    ]  # fmt: skip
    assert got[0]["ms"] == pytest.approx(50.0)
    assert got[0]["observed"] == 0.5 and got[0]["previous"] == "t0"
    assert math.isnan(got[1]["ms"])
    assert got[2]["ms"] == pytest.approx(100.0)


def test_extra_ms_is_first_over_the_median_of_the_next() -> None:
    assert sp.extra_ms(0.5, [0.4, 0.45, 0.9]) == pytest.approx(50.0)
    assert math.isnan(sp.extra_ms(0.5, []))


def test_cell_rates_and_table_row() -> None:
    cell = sp.CellResult(0.7, 4, 60.0, 0.55, rounds=20, tokens=64, requests=1, wall_s=1.0)
    assert cell.tokens_per_round == pytest.approx(3.2)
    assert cell.ms_per_round == pytest.approx(50.0)
    empty = sp.CellResult(0.7, 4, 60.0, 0.55, rounds=0, tokens=0, requests=0, wall_s=0.0)
    assert math.isnan(empty.tokens_per_round) and math.isnan(empty.ms_per_round)
    [row] = sp.table_rows([cell], {0.7: (40.0, 50.0)}, 8.0, {(0.7, 4): (3, 3)})
    assert len(row) == len(sp.TABLE_HEADERS)
    assert row[:7] == ["0.7", "4", "60.0", "40.0", "50.0", "1.50", "1.20"]
    assert row[-1] == "3/3"
    [missing] = sp.table_rows([cell], {0.7: (0.0, 50.0)}, 8.0, {})
    assert missing[5] == "-" and missing[-1] == "0/0"
    [unmeasured] = sp.table_rows([cell], {}, 8.0, {})
    assert unmeasured[3] == "-" and unmeasured[6] == "-"


def test_samples_and_prompts() -> None:
    s = sp.Sample("spec", 0, 0.5, 32, "x", True)
    assert s.tps == 64.0
    assert math.isnan(sp.Sample("spec", 0, 0.0, 32, "x", True).tps)
    assert sp.identical_counts([s, sp.Sample("spec", 1, 1, 1, "y", False)]) == (1, 2)
    prompts = sp.make_prompts(3, 5)
    assert prompts == sp.make_prompts(3, 5) and len(set(prompts)) == 5
    assert sp.draft_id(0.4) == "d40" and sp.draft_id(0.05) == "d05"


def test_plan_from_args_and_sim_flags() -> None:
    plan, path = sp.parse_args(["--quick", "--draft-ratio", "4", "--kills", "3"])
    assert plan.rates == (0.7,) and plan.ks == (4,) and plan.targets == 4
    assert path == sp.DEFAULT_JSON
    assert plan.draft_args(0.7) == (
        "--decode-ms-per-step", "5", "--prefill-us-per-token", "5", "--draft-agree-rate", "0.7",
    )  # fmt: skip
    full, _ = sp.parse_args([])
    assert full.rates == (0.4, 0.7, 0.9) and full.ks == (2, 4, 8) and full.targets == 3
    with pytest.raises(SystemExit):
        sp.parse_args(["--ks", "0"])


def test_adjacent_baselines_use_the_blocks_around_each_rate_group() -> None:
    def s(mode: str, block: int, wall: float) -> sp.Sample:
        return sp.Sample(mode, 0, wall, 10, "", True, block=block)

    samples = [
        s("target", 0, 1.0), s("direct", 0, 0.5),  # before group 0
        s("target", 1, 0.5), s("direct", 1, 0.5),  # between groups 0 and 1
        s("target", 2, 0.25), s("direct", 2, 0.25),  # after group 1
        sp.Sample("spec", 0, 0.01, 10, "", True, 0.4, 2),  # never a baseline
    ]  # fmt: skip
    got = sp.adjacent_baselines(samples, [0.4, 0.9])
    assert got[0.4] == (15.0, 20.0)  # medians of 10/1.0, 10/0.5 and of 20, 20
    assert got[0.9] == (30.0, 30.0)
