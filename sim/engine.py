"""One engine core of the simulated server: what vLLM gives each data-parallel rank.

``vllm serve --data-parallel-size N`` runs one API server in front of N engine cores.
Each core has its own KV cache (so its own prefix cache), its own scheduler (slots up
to max_num_seqs, a waiting queue, at most max_loras adapters in its batch: sim.admission),
its own loaded LoRA adapters (sim.lora) and its own KV-event publisher; the tokenizer,
model and HTTP surface are shared. sim.state's SimState holds the shared part and one
EngineRank per rank; sim.balancer picks the rank of each request.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sim.admission import Admission
from sim.cells import SharedCells
from sim.costmodel import PrefillQueue
from sim.kv_events import open_cache
from sim.lora import Adapter, AdapterCache
from sim.metrics import EngineMetrics

if TYPE_CHECKING:
    from sim.config import SimConfig


class EngineRank:
    """Created inside the running loop (its admission waits on asyncio futures)."""

    def __init__(self, rank: int, cfg: SimConfig, metrics: EngineMetrics) -> None:
        self.rank = rank
        self.metrics = metrics
        self.cache, self.kv_events = open_cache(
            cfg.cost.cache_blocks, cfg.cost.block_size, cfg.kv_events, rank
        )
        self.running_requests = 0
        self.running_seqs = 0  # sequences decoding now; drives the batch slowdown
        self.prefill = PrefillQueue()  # one card's compute: prefills take turns
        self.cells = SharedCells(cfg.kv_cells) if cfg.kv_cells > 0 else None
        lora = cfg.lora
        self.admission: Admission[asyncio.Future[None]] = Admission(
            cfg.max_num_seqs, lora.max_loras if lora else None
        )
        # The adapters this rank has loaded (sim.lora); None without --enable-lora.
        self.adapters = AdapterCache(lora.max_cpu_loras) if lora else None

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    @property
    def load(self) -> int:
        """What vLLM's load balancer weighs: requests waiting plus running."""
        return self.waiting + self.running_requests

    async def admit(self, adapter: Adapter | None = None) -> None:
        """Wait until the scheduler runs it (sim.admission: max_num_seqs, and max_loras for
        a request under an adapter); waiting requests show in num_requests_waiting. The
        caller gives its place back with release()."""
        lora = None if adapter is None else adapter.int_id
        if self.admission.try_take(lora):
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.admission.wait(lora, turn)
        waiting = self.metrics.waiting
        waiting.set(self.waiting)
        try:
            await turn
        except asyncio.CancelledError:
            if not self.admission.cancel(turn):
                self.release(adapter)  # its turn had come: the place was taken for it
            raise
        finally:
            waiting.set(self.waiting)

    def release(self, adapter: Adapter | None = None) -> None:
        # A waiter this wakes sets num_requests_waiting itself when it resumes.
        for turn in self.admission.give(None if adapter is None else adapter.int_id):
            if not turn.done():  # a cancelled one gives its place back in admit
                turn.set_result(None)

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
