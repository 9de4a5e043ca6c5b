"""Which KV-cache blocks a message prefix implies, learned from the shims' reports: a served
request's outcome carries its prompt's and reply's blocks as baton.blocks keys (a shim has the
prompt's token ids on the token path; hashes leave it, never ids). So a later request whose
prefix chain reaches a known hash implies those blocks without a tokenizer round trip, and
the engines' KV events (control/signals/kv/index.py) say which backends still hold them.

A prefix Baton has never seen implies no blocks: it is uncached everywhere as far as routing
knows, and the queue decides. Bounded: least recently used first out. Per LoRA adapter with
no table of its own: a shim roots an adapter's request's chain hashes and block keys at the
adapter (dataplane/prefix_chain.py, baton.blocks.root), so what one adapter's prefix implies is
never looked up for another's, nor for the base's."""

# baton: pure

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from baton.model import PrefixBlocks


@dataclass(frozen=True, slots=True)
class Implied:
    keys: tuple[int, ...]
    block_size: int
    tokens: int  # the prefix's length in tokens when known exactly (the prompt's), else 0


class ChainBlocks:
    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._by_hash: OrderedDict[bytes, Implied] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_hash)

    def learn(self, blocks: PrefixBlocks, reply_chain_hash: bytes, prompt_tokens: int) -> None:
        """The prompt's chain hash implies its own blocks; the reply's (the next turn's
        prefix) the prompt's and the reply's."""
        prompt = blocks.keys[: blocks.prompt_blocks]
        if blocks.prompt_chain_hash and prompt:
            self._put(blocks.prompt_chain_hash, Implied(prompt, blocks.block_size, prompt_tokens))
        if reply_chain_hash and blocks.keys:
            self._put(reply_chain_hash, Implied(blocks.keys, blocks.block_size, 0))

    def longest(self, chain: Sequence[bytes]) -> tuple[int, Implied] | None:
        """The longest prefix of `chain` with known blocks, and its index in the chain."""
        for i in range(len(chain) - 1, -1, -1):
            implied = self._by_hash.get(chain[i])
            if implied is not None:
                self._by_hash.move_to_end(chain[i])
                return i, implied
        return None

    def _put(self, key: bytes, implied: Implied) -> None:
        self._by_hash.pop(key, None)
        self._by_hash[key] = implied
        while len(self._by_hash) > self._capacity:
            self._by_hash.popitem(last=False)
