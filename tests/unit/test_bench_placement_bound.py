from __future__ import annotations

from dataclasses import replace
from statistics import median

from bench import placement_bound as pb
from bench.affinity import Plan

PLAN = Plan(conversations=4, turns=3, system_words=150, chunk_words=100, max_tokens=16)


def test_a_finished_request_loses_its_tail_before_its_prefix() -> None:
    cache = pb.PrefixCache(capacity=3)
    first = (1, 2, 3)
    assert cache.start(first) == 0
    cache.finish(first)
    assert cache.cached_blocks(first) == 3
    cache.start((9,))  # one new block evicts one: block 3, the tail
    assert cache.cached_blocks(first) == 2
    assert cache.cached_blocks((1, 2, 3, 4)) == 2


def test_a_running_request_keeps_its_blocks_and_shares_them() -> None:
    cache = pb.PrefixCache(capacity=2)
    cache.start((1, 2))
    assert cache.start((1, 2, 5)) == 2  # a second request reuses the running prefix
    cache.finish((1, 2, 5))
    assert cache.cached_blocks((1, 2)) == 2  # still held by the first request
    cache.start((7, 8))
    assert cache.cached_blocks((1, 2)) == 2  # not evictable while it runs
    assert cache.cached_blocks((1, 2, 5)) == 2  # the finished tail went instead


def test_block_hashes_chain_the_whole_prefix() -> None:
    a = pb.block_hashes(b"a" * 300)
    assert len(a) == 2  # a partial block is not cached
    b = pb.block_hashes(b"b" + b"a" * 299)
    assert not set(a) & set(b)  # one byte early changes every later block


def test_caches_that_hold_every_conversation_reprefill_only_new_turns() -> None:
    roomy = pb.simulate(PLAN, pb.sticky, capacity=1000, seed=0)
    tight = pb.simulate(PLAN, pb.sticky, capacity=20, seed=0)
    assert len(roomy.warm_ttft_ms) == 4 * 2
    assert roomy.hit_ratio > 0.5
    assert tight.hit_ratio < roomy.hit_ratio
    # Moving every turn to the least backlog throws the cached prefixes away.
    moving = pb.simulate(PLAN, pb.least_backlog, capacity=1000, seed=0)
    assert moving.hit_ratio < roomy.hit_ratio


def test_the_table_compares_every_placement_to_sticky_on_the_same_workloads() -> None:
    plan = replace(PLAN, conversations=3)
    rows = pb.table(plan, [1000], seeds=2)
    assert [r.placement for r in rows] == [*pb.PLACEMENTS, "best static in hindsight"]
    assert rows[0].vs_sticky == 1.0
    assert "p50/sticky" in pb.render(rows)


def test_the_hindsight_search_is_never_worse_than_sticky() -> None:
    # Sticky ends up as one static assignment (or its mirror), which the search includes.
    for seed in range(3):
        best = pb.hindsight(PLAN, 20, seed)
        mine = pb.simulate(PLAN, pb.sticky, 20, seed)
        assert median(best.warm_ttft_ms) <= median(mine.warm_ttft_ms)
