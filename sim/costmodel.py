"""Where the simulated time goes (pure; the server does the sleeping).

* Prefill: a cost per prompt token that is NOT in this replica's prefix cache
  (sim.kvcache: fixed-size token blocks keyed by the chain hash of their
  contents, like vLLM's automatic prefix caching), so routing a conversation
  back to the replica that served its prefix shows up as a lower TTFT — exactly
  the effect routing policies are judged by.
* Decode: a cost per step that grows with the number of sequences decoding at
  once (batching is not free).

Every cost can be 0; then the server never sleeps.
"""

# baton: pure

from __future__ import annotations

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
