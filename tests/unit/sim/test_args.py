"""`python -m sim` flags -> SimConfig, and the config facts exported in /metrics."""

from __future__ import annotations

import pytest

from sim.metrics import SimMetrics
from tests.factories import sim_config


def test_defaults_are_the_plain_model_and_vllms_generation_defaults() -> None:
    cfg = sim_config()
    assert cfg.model.draft_agree_rate == 1.0 and cfg.model.loop_period == 0
    lim = cfg.limits
    assert (lim.default_temperature, lim.default_top_p, lim.default_top_k) == (0.0, 1.0, 0)
    assert lim.default_seed is None and cfg.tokenizer_variant == 0
    assert not cfg.byte_level and not cfg.reasoning and cfg.model.think_tokens == 32


def test_new_flags_reach_the_config() -> None:
    cfg = sim_config(
        "--draft-agree-rate", "0.4", "--default-temperature", "0.7", "--default-top-p", "0.9",
        "--default-top-k", "-1", "--default-seed", "5", "--tokenizer-variant", "2",
        "--loop-after-len", "100", "--loop-period", "8",
    )
    assert cfg.model.draft_agree_rate == 0.4
    assert (cfg.model.loop_after_len, cfg.model.loop_period) == (100, 8)
    lim = cfg.limits
    # top_k -1 and 0 both mean off; one spelling so equal configs report equal facts.
    assert (lim.default_temperature, lim.default_top_p, lim.default_top_k) == (0.7, 0.9, 0)
    assert lim.default_seed == 5 and cfg.tokenizer_variant == 2


@pytest.mark.parametrize(
    "argv",
    [
        ("--draft-agree-rate", "1.5"),
        ("--draft-agree-rate", "-0.1"),
        ("--default-top-p", "0"),
        ("--default-top-k", "-2"),
        ("--default-temperature", "-1"),
        ("--loop-period", "-1"),
        ("--think-tokens", "-1"),
        ("--think-tokens", "20000"),
    ],
)
def test_out_of_range_flags_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit):
        sim_config(*argv)


def test_cache_config_info_gauge_carries_the_block_size() -> None:
    text = SimMetrics("toy", block_size=32, cache_blocks=100).render().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert 'block_size="32"' in line and 'num_gpu_blocks="100"' in line
    assert line.endswith(" 1.0")


def test_byte_level_and_reasoning_flags_reach_the_config() -> None:
    cfg = sim_config("--byte-level", "--reasoning", "--think-tokens", "7")
    assert cfg.byte_level and cfg.reasoning and cfg.model.think_tokens == 7
