"""One engine core of the simulated server: what vLLM gives each data-parallel rank.

``vllm serve --data-parallel-size N`` runs one API server in front of N engine cores.
Each core has its own KV cache (so its own prefix cache), its own scheduler (slots up
to max_num_seqs, a waiting queue) and its own KV-event publisher; the tokenizer, model
and HTTP surface are shared. sim.state's SimState holds the shared part and one
EngineRank per rank; sim.balancer picks the rank of each request.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sim.cells import SharedCells
from sim.costmodel import PrefillQueue
from sim.kv_events import open_cache
from sim.metrics import EngineMetrics

if TYPE_CHECKING:
    from sim.config import SimConfig


class EngineRank:
    """Created inside the running loop (it owns an asyncio semaphore)."""

    def __init__(self, rank: int, cfg: SimConfig, metrics: EngineMetrics) -> None:
        self.rank = rank
        self.metrics = metrics
        self.cache, self.kv_events = open_cache(
            cfg.cost.cache_blocks, cfg.cost.block_size, cfg.kv_events, rank
        )
        self.running_requests = 0
        self.running_seqs = 0  # sequences decoding now; drives the batch slowdown
        self.waiting = 0
        self.prefill = PrefillQueue()  # one card's compute: prefills take turns
        self.cells = SharedCells(cfg.kv_cells) if cfg.kv_cells > 0 else None
        self.slots = asyncio.Semaphore(max(1, cfg.max_num_seqs))

    @property
    def load(self) -> int:
        """What vLLM's load balancer weighs: requests waiting plus running."""
        return self.waiting + self.running_requests

    async def admit(self) -> None:
        """Wait for a slot (max_num_seqs); waiting requests show in num_requests_waiting.
        The caller gives it back with release()."""
        if not self.slots.locked():
            await self.slots.acquire()  # does not suspend when a slot is free
            return
        self.waiting += 1
        self.metrics.waiting.set(self.waiting)
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
            self.metrics.waiting.set(self.waiting)

    def release(self) -> None:
        self.slots.release()

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
