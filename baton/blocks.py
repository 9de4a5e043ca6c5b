"""Baton's own keys for KV-cache blocks: one 64-bit key per *full* block of token ids, rolling
over the blocks before it (`key_i = H(key_{i-1}, tokens of block i)`), so a key names a block
together with its whole prefix, like an engine's own block hash.

They are independent of any engine's internal hash (vLLM's depends on its hash function, its
seed and extra keys), stable across processes and machines (blake2b, no seed), and computed
the same from a request's prompt ids (the shim) and from an engine's BlockStored token ids
(control's KV index): both sides meet on these keys. A partial last block has no key:
engines cache full blocks only.

A chain starts at `root(adapter)`: ROOT for the base model, a key of its own for each LoRA
adapter, since an engine caches the same tokens under two adapters (or none) as different
blocks (vLLM hashes the adapter in) and neither may be credited for the other's."""

# baton: pure

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b

ROOT = 0  # the parent of a prompt's first block (the base model's)
_PERSON = b"baton.blocks.v1"  # blake2b's personalisation: these digests mean nothing else
_ROOT_PERSON = b"baton.lora.root"  # another: an adapter's root is never some block's key


def root(adapter: str | None) -> int:
    """The parent of a prompt's first block under LoRA adapter `adapter` (its name, as
    clients send it in `model` and vLLM reports it as a block's lora_name); ROOT for the base
    model (None or ""), so the base's keys are what they always were."""
    if not adapter:
        return ROOT
    digest = blake2b(adapter.encode(), digest_size=8, person=_ROOT_PERSON).digest()
    return int.from_bytes(digest, "big")


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """The key of one block: its parent's key and its token ids (each an unsigned 32-bit id)."""
    try:
        body = struct.pack(f">Q{len(tokens)}I", parent, *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be in 0..2**32-1, parent in 0..2**64-1: {exc}") from None
    return int.from_bytes(blake2b(body, digest_size=8, person=_PERSON).digest(), "big")


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The keys of every full block of `token_ids`, in order, chained from `parent`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
