"""The replica's KV cache: a pool of fixed-size token blocks with prefix caching (pure).

It follows vLLM 0.32's BlockPool (vllm/v1/core/block_pool.py) closely enough that the
KV-cache events it emits are the ones vLLM would emit for the same requests:

* A sequence holds ``ceil(computed tokens / block_size)`` blocks (the newest sampled
  token is computed on the next step, so a sequence that stops there never holds a
  block for it; vLLM allocates no slot for it either). Its leading full blocks that
  are cached are shared (touched: taken off the eviction list); at most
  ``(prompt - 1) // block_size`` of them, since vLLM always computes the last prompt
  token, so a fully cached block-aligned prompt recomputes its last block and stores
  that hash once more (vLLM does the same: a second block under one hash).
* Every block that becomes full of computed tokens is cached: the prompt's at once,
  generated ones as decoding fills them (a finished sequence caches
  ``(prompt + generated - 1) // bs`` blocks). Each such step is one ``BlockStored``
  (the new hashes, the parent's hash, their token ids).
* A freed sequence's cached blocks stay, as eviction candidates in LRU order (its
  tail first); its partial block is free at once. A new block takes a free one,
  else evicts the least recent candidate: one ``BlockRemoved`` per block.
* ``reset()`` drops every cached hash when no block is held (``AllBlocksCleared``).
* A sequence under a LoRA adapter (``LoraTag``) hashes its blocks with the adapter's
  extra key, as vLLM does: the same tokens under another adapter (or none) share nothing;
  its ``BlockStored`` carry the adapter's lora_id, lora_name and extra keys.

Usage (vllm:kv_cache_usage_perc) is held blocks / capacity, as vLLM counts it:
cached blocks nobody holds are free. Capacity 0 turns the cache off.

The prefill cost reads ``CacheLookup``: the leading cached tokens, at most
``prompt - 1`` (the cost model's rule, kept as it was).
"""

# baton: pure

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sim.kv_wire import AllBlocksCleared, KvEvent, removed, stored

_MASK = (1 << 64) - 1
_ROOT = 0  # the parent "hash" of a chain's first block


def block_hash(parent: int | None, tokens: Sequence[int], extra: int | None = None) -> int:
    """A deterministic unsigned 64-bit hash of (parent hash, the block's token ids) and, for
    a sequence under a LoRA adapter, its extra key (vLLM hashes ("lora", name, path) in)."""
    root = _ROOT if parent is None else parent
    if extra is None:
        return hash((root, tuple(tokens))) & _MASK
    return hash((root, tuple(tokens), extra)) & _MASK


@dataclass(frozen=True, slots=True)
class LoraTag:
    """A sequence's adapter as its blocks know it: the extra key their hashes fold in
    (sim.lora's Adapter.kv_key), and the lora_id and lora_name of their BlockStored."""

    key: int
    lora_id: int
    name: str


@dataclass(frozen=True, slots=True)
class CacheLookup:
    query_tokens: int  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hit_tokens: int  # leading tokens served from cache (prefix_cache_hits)

    @property
    def uncached_tokens(self) -> int:
        return self.query_tokens - self.hit_tokens


class _Block:
    __slots__ = ("hash", "ref")

    def __init__(self) -> None:
        self.hash: int | None = None
        self.ref = 0


class PrefixCache:
    """Mutable by design (it is the replica's KV cache); owned by one server.

    ``events``: collect KV-cache events (``take_events``); ``on_event`` is called when
    the first event lands after a take, so the owner can publish them as one batch.
    """

    __slots__ = ("_bs", "_capacity", "_free", "_held", "_by_hash", "_evictable", "_events",
                 "_on_event")  # fmt: skip

    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        *,
        events: bool = False,
        on_event: Callable[[], None] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self._bs = block_size
        self._capacity = max(0, capacity_blocks)
        self._free = self._capacity  # below 0 while more is held than fits (no preemption)
        self._held = 0
        self._by_hash: dict[int, list[_Block]] = {}
        self._evictable: OrderedDict[_Block, None] = OrderedDict()
        self._events: list[KvEvent] | None = [] if events else None
        self._on_event = on_event

    # -- what the server reads -------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def used_blocks(self) -> int:
        """Blocks held by running sequences (vLLM's "used")."""
        return self._held

    @property
    def cached_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._by_hash.values())

    @property
    def usage(self) -> float:
        return min(1.0, self._held / self._capacity) if self._capacity else 0.0

    def take_events(self) -> list[KvEvent]:
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    # -- lookups and sequences -------------------------------------------------------
    def chain_hashes(self, ids: Sequence[int], lora: LoraTag | None = None) -> list[int]:
        """h_i = H(h_{i-1}, block_i) over full blocks only (a partial block is never cached)."""
        bs, out, h = self._bs, [], None
        extra = None if lora is None else lora.key
        for start in range(0, len(ids) - bs + 1, bs):
            h = block_hash(h, ids[start : start + bs], extra)
            out.append(h)
        return out

    def lookup(self, ids: Sequence[int], lora: LoraTag | None = None) -> CacheLookup:
        """Count the cached leading tokens (read-only)."""
        return self._lookup(ids, self.chain_hashes(ids, lora) if self._capacity else [])

    def open(
        self, prompt: list[int], generated: list[int], lora: LoraTag | None = None
    ) -> KvSeq:
        """Admit one sequence: share its cached prefix, take blocks for the rest and
        cache the prompt's full blocks. ``generated`` is the sequence's output list,
        read (never written) as it grows; see ``KvSeq.grow``. Under an adapter (``lora``)
        its blocks are that adapter's: no other sequence's hashes match them."""
        seq = KvSeq(self, prompt, generated, lora)
        if self._capacity:
            hashes = self.chain_hashes(prompt, lora)
            seq.lookup = self._lookup(prompt, hashes)
            for h in hashes[: (len(prompt) - 1) // self._bs]:
                blocks = self._by_hash.get(h)
                if blocks is None:
                    break
                self._touch(blocks[0])
                seq.blocks.append(blocks[0])
                seq.hashes.append(h)
            seq.grow()
        else:
            seq.lookup = CacheLookup(len(prompt), 0)
        return seq

    def insert(self, ids: list[int]) -> None:
        """Cache every full block of ``ids`` as one finished sequence would."""
        self.open(ids, []).close()

    def reset(self) -> bool:
        """Drop every cached block (vLLM's reset_prefix_cache); refused while any is held."""
        if self._held:
            return False
        self._by_hash.clear()
        self._evictable.clear()
        self._free = self._capacity
        self._emit(AllBlocksCleared())
        return True

    # -- the pool ----------------------------------------------------------------------
    def _lookup(self, ids: Sequence[int], hashes: list[int]) -> CacheLookup:
        n = len(ids)
        hit = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            hit += 1
        # Like vLLM, at least the last prompt token is always computed.
        return CacheLookup(n, min(hit * self._bs, max(n - 1, 0)))

    def _touch(self, block: _Block) -> None:
        if block.ref == 0:
            del self._evictable[block]
            self._held += 1
        block.ref += 1

    def _take(self) -> _Block:
        """A block for a sequence: a free one, else the least recent cached one."""
        self._held += 1
        if self._free > 0 or not self._evictable:
            self._free -= 1
            block = _Block()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        block.ref = 1
        return block

    def _uncache(self, block: _Block) -> None:
        h = block.hash
        if h is None:
            return
        blocks = self._by_hash[h]
        blocks.remove(block)
        if not blocks:
            del self._by_hash[h]
        block.hash = None
        self._emit(removed(h))

    def _cache(self, block: _Block, h: int) -> None:
        block.hash = h
        self._by_hash.setdefault(h, []).append(block)

    def _release(self, blocks: list[_Block]) -> None:
        """Tail first, as vLLM frees them: a chain's suffix is evicted before its prefix."""
        for block in reversed(blocks):
            block.ref -= 1
            if block.ref:
                continue
            self._held -= 1
            if block.hash is None:
                self._free += 1
            else:
                self._evictable[block] = None
        while self._free < 0 and self._evictable:  # held more than fits: give it back now
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free += 1

    def _emit(self, event: KvEvent) -> None:
        events = self._events
        if events is None:
            return
        events.append(event)
        if len(events) == 1 and self._on_event is not None:
            self._on_event()


class KvSeq:
    """One sequence's blocks (a request's choice). Mutable; owned by one Run."""

    __slots__ = ("_cache", "_prompt", "_out", "_lora", "blocks", "hashes", "lookup")

    def __init__(
        self, cache: PrefixCache, prompt: list[int], generated: list[int],
        lora: LoraTag | None = None,
    ) -> None:
        self._cache = cache
        self._prompt = prompt
        self._out = generated
        self._lora = lora
        self.blocks: list[_Block] = []
        self.hashes: list[int] = []  # of the leading full blocks cached so far
        self.lookup = CacheLookup(len(prompt), 0)

    def grow(self) -> bool:
        """Catch up with the tokens generated so far; True when it took blocks."""
        c = self._cache
        if not c._capacity:
            return False
        # The newest sampled token is computed (takes a slot) on the next step only.
        computed = len(self._prompt) + max(len(self._out) - 1, 0)
        bs, blocks = c._bs, self.blocks
        took = False
        while len(blocks) * bs < computed:
            blocks.append(c._take())
            took = True
        first = len(self.hashes)
        if computed // bs > first:
            self._store(first, computed // bs)
        return took

    def _store(self, first: int, full: int) -> None:
        c, bs, hashes = self._cache, self._cache._bs, self.hashes
        parent = hashes[-1] if hashes else None
        tokens = self._tokens(first * bs, full * bs)
        lora = self._lora
        extra = None if lora is None else lora.key
        for i in range(full - first):
            h = block_hash(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], extra)
            c._cache(self.blocks[first + i], h)
            hashes.append(h)
        if c._events is not None:
            tag = None if lora is None else (lora.lora_id, lora.name)
            c._emit(stored(hashes[first:], parent, tokens, bs, tag))

    def _tokens(self, start: int, end: int) -> list[int]:
        p = self._prompt
        n = len(p)
        if end <= n:
            return p[start:end]
        return p[start:] + self._out[: end - n] if start < n else self._out[start - n : end - n]

    def close(self) -> None:
        """The sequence is done (finished, aborted or cut): its blocks go back."""
        self._cache._release(self.blocks)
        self.blocks = []
