"""One generation's use of the engine rank serving it (plumbing): the running counts and
metrics, its KV blocks and shared-context cells from begin to end, its LoRA adapter (the
model it runs, the load it may pay before prefill, its place in vllm:lora_requests_info),
prefill admission, the pace of decode steps, the first token's timing. sim.run's Run is
the generation itself.
"""

from __future__ import annotations

import asyncio
import time
from random import Random
from typing import TYPE_CHECKING

from sim import specdecode, timing
from sim.generation import Sequence
from sim.kvcache import KvSeq, LoraTag
from sim.protocol import GenRequest

if TYPE_CHECKING:
    from sim.engine import EngineRank
    from sim.lora import Adapter
    from sim.state import SimState


class EngineUse:
    """The bookkeeping of one run on its rank; a subclass makes ``seqs`` (one per choice)."""

    def __init__(
        self, state: SimState, engine: EngineRank, req: GenRequest, adapter: Adapter | None = None
    ) -> None:
        self.state = state  # shared: model, tokenizer, config, response store, timing log
        self.engine = engine  # the rank serving it: cache, slots, queues, metrics
        self.req = req
        # The LoRA adapter it runs under (sim.lora), and the model that makes: the base's
        # with the adapter's weights on top.
        self.adapter = adapter
        self.model = state.model if adapter is None else state.model.with_adapter(adapter.identity)
        self._loras = state.loras if state.loras.enabled else None
        self.t0 = time.perf_counter()
        self.ttft_recorded = False
        self.outcome = "abort"  # until proven otherwise: cancellation lands here
        self.cached_tokens = 0  # prompt tokens the prefix cache held (set by begin)
        self._kv: list[KvSeq] = []  # each choice's KV blocks, from begin to end
        self._cells = 0  # of the shared context (--kv-cells) this run holds
        self._epoch = 0  # the shared context's epoch it began in (-1: it never fitted)
        self._prefill_s = 0.0
        self.prompt_hash = self.model.start(req.prompt_ids)
        self.seqs: list[Sequence] = []

    def begin(self) -> None:
        st, eng, m = self.state, self.engine, self.engine.metrics
        eng.running_requests += 1
        eng.running_seqs += self.req.n
        m.running.set(eng.running_requests)
        prompt = self.req.prompt_ids
        m.prompt_tokens.inc(len(prompt))
        adapter = self.adapter
        tag = None if adapter is None else LoraTag(adapter.kv_key, adapter.int_id, adapter.name)
        # Each choice is a sequence with its own blocks (the prompt's are shared).
        self._kv = [eng.cache.open(prompt, s.token_ids, tag) for s in self.seqs]
        lookup = self._kv[0].lookup
        self._kv_usage()
        m.cache_queries.inc(lookup.query_tokens)
        if lookup.hit_tokens:
            m.cache_hits.inc(lookup.hit_tokens)
        self.cached_tokens = lookup.hit_tokens
        cells = eng.cells
        if cells is not None:
            need = len(prompt) * self.req.n
            fits = cells.take(need)
            self._cells, self._epoch = (need, cells.epoch) if fits else (0, -1)
        self._prefill_s = st.cfg.cost.prefill_seconds(lookup.uncached_tokens)
        if adapter is not None:
            self._prefill_s += self._use_adapter(adapter)
        if self.req.prompt_logprobs is not None:
            # A scoring pass is one more forward step over the new tokens
            # (memory-bound like a decode step), not a free by-product of the
            # prefill: otherwise router-side verification would look free.
            self._prefill_s += self._step_delay()

    def _use_adapter(self, adapter: Adapter) -> float:
        """Its adapter joins this rank's batch: the seconds it takes to load it first (it
        was evicted since, or never loaded here), else 0."""
        cache, lora = self.engine.adapters, self.state.cfg.lora
        if cache is None or lora is None or not cache.start(adapter):
            return 0.0
        self.state.loras.loaded(adapter, self.engine.rank)
        return lora.load_s

    def end(self) -> None:
        st, eng, m = self.state, self.engine, self.engine.metrics
        eng.running_requests -= 1
        eng.running_seqs -= self.req.n
        m.running.set(eng.running_requests)
        generated = sum(len(s.token_ids) for s in self.seqs)
        if generated:
            m.generation_tokens.inc(generated)
            if m.spec is not None:
                rng = Random(hash((self.prompt_hash, st.cfg.model.chip_seed)))
                m.spec.add(specdecode.count(st.cfg.spec, generated, rng))
        m.success[self.outcome].inc()
        m.e2e.observe(time.perf_counter() - self.t0)
        # The blocks decoding filled stay cached (vLLM keeps them, whatever the outcome):
        # the next turn of a conversation can hit them (up to where retokenization differs).
        for kv in self._kv:
            kv.close()
        self._kv = []
        self._kv_usage()
        if eng.cells is not None:
            eng.cells.give(self._cells)
            self._cells = 0
        if self.adapter is not None and eng.adapters is not None:
            eng.adapters.finish(self.adapter)
        if self._loras is not None:
            self._loras.finished(self.adapter, id(self))

    def _kv_usage(self) -> None:
        cache = self.engine.cache
        if cache.capacity:
            self.engine.metrics.kv_usage.set(cache.usage)

    def _stepped(self) -> None:
        """After each decode step: the first token's timing, and the blocks it filled."""
        self._first_token()
        took = False
        for kv in self._kv:
            took |= kv.grow()
        if took:
            self._kv_usage()

    async def _prefill(self) -> None:
        if self._prefill_s > 0:
            now = asyncio.get_running_loop().time()
            await asyncio.sleep(self.engine.prefill.admit(now, self._prefill_s))

    def _exceeded(self) -> bool:
        """Before a decode step: whether the shared context has no cell for it, or overflowed
        since this run began (which failed every sequence being processed)."""
        cells = self.engine.cells
        if cells is None:
            return False
        if cells.epoch != self._epoch or not cells.take(1):
            return True
        self._cells += 1
        return False

    def _step_delay(self) -> float:
        return self.state.cfg.cost.decode_step_seconds(self.engine.running_seqs)

    def _first_token(self) -> None:
        if not self.ttft_recorded:
            self.ttft_recorded = True
            if self._loras is not None:
                self._loras.started(self.adapter, id(self))
            ttft = time.perf_counter() - self.t0
            self.engine.metrics.ttft.observe(ttft)
            if self.state.timing is not None:
                self.state.timing.write(timing.record(self.req.prompt_ids, ttft))

    def _settle(self) -> None:
        reason = self.seqs[0].finish_reason
        self.outcome = reason if reason in ("stop", "length") else "abort"
