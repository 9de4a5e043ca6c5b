from __future__ import annotations

import pytest

from sim.costmodel import CostParams
from sim.kvcache import PrefixCache


def test_prefill_costs_only_uncached_tokens() -> None:
    cost = CostParams(prefill_us_per_token=20.0)
    assert cost.prefill_seconds(1000) == pytest.approx(0.02)
    assert cost.prefill_seconds(0) == 0.0


def test_decode_step_grows_with_concurrent_sequences() -> None:
    cost = CostParams(decode_ms_per_step=5.0, batch_slowdown=0.02)
    assert cost.decode_step_seconds(1) == pytest.approx(0.005)
    assert cost.decode_step_seconds(11) == pytest.approx(0.005 * 1.2)
    assert CostParams(decode_ms_per_step=0.0).decode_step_seconds(50) == 0.0


def test_all_zero_is_instant() -> None:
    assert CostParams(prefill_us_per_token=0, decode_ms_per_step=0).instant
    assert not CostParams().instant


def test_prefix_hits_count_leading_full_blocks() -> None:
    cache = PrefixCache(capacity_blocks=100, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert cache.lookup(prompt).hit_tokens == 0
    cache.insert(prompt)
    assert cache.lookup(prompt).hit_tokens == 8
    longer = [*prompt[:8], 99, 98, 97, 96, 95]
    assert cache.lookup(longer).hit_tokens == 8
    assert cache.lookup(longer).uncached_tokens == 5
    diverged = [0, 1, 2, 3, 9, 9, 9, 9]  # block 2 differs: chain stops there
    assert cache.lookup(diverged).hit_tokens == 4


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    cache = PrefixCache(capacity_blocks=10, block_size=4)
    cache.insert(list(range(8)))
    lookup = cache.lookup(list(range(8)))
    assert (lookup.hit_tokens, lookup.uncached_tokens) == (7, 1)


def test_same_block_at_another_position_is_a_miss() -> None:
    cache = PrefixCache(capacity_blocks=10, block_size=2)
    cache.insert([1, 2, 3, 4])
    assert cache.lookup([3, 4, 1, 2]).hit_tokens == 0


def test_lru_evicts_least_recent_and_suffixes_first() -> None:
    cache = PrefixCache(capacity_blocks=3, block_size=2)
    a, b = [1, 1, 2, 2], [7, 7, 8, 8]
    cache.insert(a)
    cache.insert(b)  # 4 blocks > 3: a's suffix block goes first
    assert cache.cached_blocks == 3
    assert cache.lookup(a).hit_tokens == 2
    assert cache.lookup(b).hit_tokens == 3  # full prompt: last token recomputed


def test_zero_capacity_disables_the_cache() -> None:
    cache = PrefixCache(capacity_blocks=0, block_size=16)
    cache.insert(list(range(64)))
    assert cache.lookup(list(range(64))).hit_tokens == 0
    assert cache.cached_blocks == 0


def test_spec_decode_counters_follow_the_acceptance_rate() -> None:
    from random import Random

    from sim.specdecode import SpecConfig, count

    c = count(SpecConfig(num_tokens=4, acceptance=0.6), 10_000, Random(0))
    assert c.draft_tokens == 4 * c.drafts
    assert c.drafts + c.accepted_tokens >= 10_000  # each step yields accepted + 1 tokens
    assert list(c.accepted_per_pos) == sorted(c.accepted_per_pos, reverse=True)
    assert 0.6 == pytest.approx(c.accepted_per_pos[0] / c.drafts, abs=0.03)
    assert count(SpecConfig(num_tokens=3, acceptance=0.0), 50, Random(0)).accepted_tokens == 0


def test_prefills_queue_behind_each_other_on_one_card() -> None:
    from pytest import approx

    from sim.costmodel import PrefillQueue

    q = PrefillQueue()
    assert q.admit(10.0, 0.5) == approx(0.5)  # idle card: just its own prefill
    assert q.admit(10.1, 0.5) == approx(0.9)  # waits for the first (done at 10.5), then 0.5
    assert q.admit(20.0, 0.2) == approx(0.2)  # the card went idle again
    assert q.admit(20.0, 0.0) == 0.0  # a fully cached prompt never waits
