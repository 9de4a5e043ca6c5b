"""Which data-parallel rank serves a request: vLLM 0.32's internal load balancer (pure).

* ``X-data-parallel-rank: R`` pins a chat or completion request to rank R
  (``_get_data_parallel_rank`` in entrypoints/generate/base/serving.py). A value that
  is not an integer is ignored, as if absent; an integer outside [0, N) is refused
  (input_processor.py: "data_parallel_rank R is out of range [0, N)."), a 400.
  /v1/responses never reads the header there, so it is always balanced.
* Without it, ``DPLBAsyncMPClient.get_core_engine_for_request`` (v1/engine/core_client.py)
  takes the least loaded engine: waiting + running requests. Its scan starts at a
  rotating index, one further after every balanced pick, and only a strictly lower
  load displaces the engine it found first; so ties go round robin (an idle pair of
  engines takes alternate requests) and a busy engine is passed over. vLLM reads the
  counts from the engines' stats (every 100 ms, floored by its own in-flight count);
  the sim knows them exactly, which is the count vLLM's floor keeps.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence

from sim.protocol import bad_request

RANK_HEADER = "X-data-parallel-rank"


def header_rank(value: str | None) -> int | None:
    """The header as vLLM reads it: ``int(value)``, or None when absent or not an integer."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


class LeastLoaded:
    """One API server's balancer over `size` engines."""

    __slots__ = ("size", "_start")

    def __init__(self, size: int) -> None:
        self.size = size
        self._start = 0  # vLLM's eng_start_index (one API server: client index 0)

    def pick(self, loads: Sequence[int], pinned: int | None = None) -> int:
        """The rank for a request; `loads[r]` is rank r's waiting + running requests.

        Raises the sim's 400 for a pinned rank out of range."""
        if pinned is not None:
            if not 0 <= pinned < self.size:
                raise bad_request(
                    f"data_parallel_rank {pinned} is out of range [0, {self.size})."
                )
            return pinned
        best, best_load = 0, None
        for i in range(self.size):
            idx = (self._start + i) % self.size
            if best_load is None or loads[idx] < best_load:
                best, best_load = idx, loads[idx]
        self._start = (self._start + 1) % self.size
        return best
