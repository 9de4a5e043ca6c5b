"""Where the simulated time goes (pure; the server does the sleeping).

* Prefill: a cost per prompt token that is NOT in this replica's prefix cache.
  The cache is an LRU of fixed-size token blocks keyed by the chain hash of
  block contents (like vLLM's automatic prefix caching), so routing a
  conversation back to the replica that served its prefix shows up as a lower
  TTFT — exactly the effect routing policies are judged by.
* Decode: a cost per step that grows with the number of sequences decoding at
  once (batching is not free).

Every cost can be 0; then the server never sleeps.
"""

# baton: pure

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostParams:
    prefill_us_per_token: float = 20.0
    decode_ms_per_step: float = 5.0
    batch_slowdown: float = 0.02  # +2% step time per extra concurrent sequence
    cache_blocks: int = 4096
    block_size: int = 16

    @property
    def instant(self) -> bool:
        return self.prefill_us_per_token <= 0 and self.decode_ms_per_step <= 0

    def prefill_seconds(self, uncached_tokens: int) -> float:
        return max(0.0, uncached_tokens * self.prefill_us_per_token * 1e-6)

    def decode_step_seconds(self, running: int) -> float:
        if self.decode_ms_per_step <= 0:
            return 0.0
        extra = max(0, running - 1) * max(0.0, self.batch_slowdown)
        return self.decode_ms_per_step * 1e-3 * (1.0 + extra)


class PrefillQueue:
    """Prefill is compute-bound: a card works through concurrent prefills one after another
    (so piling a cold burst onto one replica costs what it costs on a real fleet), while
    decode steps of running sequences are batched (see decode_step_seconds)."""

    __slots__ = ("_free_at",)

    def __init__(self) -> None:
        self._free_at = 0.0

    def admit(self, now: float, seconds: float) -> float:
        """Seconds from `now` until this prefill is done, queued behind earlier ones."""
        if seconds <= 0:
            return 0.0
        start = max(now, self._free_at)
        self._free_at = start + seconds
        return self._free_at - now


@dataclass(frozen=True, slots=True)
class CacheLookup:
    query_tokens: int  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hit_tokens: int  # leading tokens served from cache (prefix_cache_hits)

    @property
    def uncached_tokens(self) -> int:
        return self.query_tokens - self.hit_tokens


class PrefixCache:
    """LRU of full token blocks keyed by chain hash; capacity in blocks (0 = off).

    Mutable by design (it is the replica's KV cache); owned by one server.
    """

    __slots__ = ("_blocks", "_capacity", "_block_size")

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._capacity = max(0, capacity_blocks)
        self._block_size = block_size

    @property
    def used_blocks(self) -> int:
        return len(self._blocks)

    @property
    def capacity(self) -> int:
        return self._capacity

    def chain_hashes(self, ids: Sequence[int]) -> list[int]:
        """h_i = H(h_{i-1}, block_i) over full blocks only (a partial block is never cached)."""
        bs = self._block_size
        out: list[int] = []
        h = 0
        for start in range(0, len(ids) - bs + 1, bs):
            h = hash((h, tuple(ids[start : start + bs])))
            out.append(h)
        return out

    def lookup(self, ids: Sequence[int]) -> CacheLookup:
        """Count the cached leading tokens (read-only).

        Like vLLM, at least the last prompt token is always computed, so a fully
        cached prompt still reports one uncached token.
        """
        n = len(ids)
        if self._capacity == 0 or n == 0:
            return CacheLookup(n, 0)
        blocks = self._blocks
        hit_blocks = 0
        for h in self.chain_hashes(ids):
            if h not in blocks:
                break
            hit_blocks += 1
        return CacheLookup(n, min(hit_blocks * self._block_size, n - 1))

    def insert(self, ids: Sequence[int]) -> None:
        """Admit/refresh every full block of ``ids`` (a prompt, or prompt + output)."""
        if self._capacity == 0:
            return
        blocks = self._blocks
        # Refresh tail-first so the head of a chain is the most recently used:
        # eviction then drops suffixes before the prefixes they depend on.
        for h in reversed(self.chain_hashes(ids)):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)
