"""What one running sim server owns (SimState), and the app key every handler finds it by.

Shared by the server's composition and every route module (sim.*_http), so it lives
apart from both: the route modules import it, never the module that assembles them.
"""

from __future__ import annotations

import time

from aiohttp import web

from sim.balancer import RANK_HEADER, LeastLoaded, header_rank
from sim.config import SimConfig
from sim.engine import EngineRank
from sim.lora_runtime import Loras
from sim.metrics import SimMetrics
from sim.model import ToyModel
from sim.responses_store import ResponseStore
from sim.tokenizer import build_tokenizer


class SimState:
    """Everything one sim server owns; created inside the running loop. The engine
    state lives in `engines` (one EngineRank per data-parallel rank); the rest is shared."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.tokenizer = build_tokenizer(
            cfg.tokenizer_variant, byte_level=cfg.byte_level, reasoning=cfg.reasoning,
            tool_calls=cfg.tool_calls, think_special=cfg.think_special,
            drop_merge=cfg.tokenizer_drop_merge,
        )
        self.model = ToyModel(cfg.model, self.tokenizer)
        size = max(1, cfg.data_parallel_size)
        self.metrics = SimMetrics(
            cfg.limits.model,
            spec_positions=cfg.spec.num_tokens,
            block_size=cfg.cost.block_size,
            cache_blocks=cfg.cost.cache_blocks,
            engines=size,
            max_loras=cfg.lora.max_loras if cfg.lora is not None else None,
        )
        self.engines: list[EngineRank] = []
        try:
            for rank in range(size):
                self.engines.append(EngineRank(rank, cfg, self.metrics.engines[rank]))
        except BaseException:  # a later rank's publisher failed: close the earlier ones
            self.close()
            raise
        self.balancer = LeastLoaded(size)
        # Adapters (vLLM's --enable-lora): the registry is there either way, as vLLM's is.
        self.loras = Loras(cfg, self.engines, self.metrics.lora)
        self.fingerprint = f"sim-{cfg.model.seed}"
        self.created = int(time.time())
        # Unbuffered appends: a SIGKILLed sim keeps every line it wrote (benchmarks kill them).
        self.responses = ResponseStore(cfg.responses_store)
        self.timing = open(cfg.timing_log, "ab", buffering=0) if cfg.timing_log else None  # noqa: SIM115

    def engine_for(self, request: web.Request, *, pinnable: bool = True) -> EngineRank:
        """The rank that serves this request: the one its X-data-parallel-rank header
        names (where vLLM reads it: `pinnable`), else the least loaded."""
        pinned = header_rank(request.headers.get(RANK_HEADER)) if pinnable else None
        return self.engines[self.balancer.pick([e.load for e in self.engines], pinned)]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


STATE = web.AppKey("sim_state", SimState)
