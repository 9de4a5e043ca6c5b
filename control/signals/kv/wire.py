"""vLLM's KV-cache event wire format, and its translation into the KV index's events.

The Structs mirror vllm/distributed/kv_events.py (vLLM 0.32) field for field, with the same
msgspec settings: an `EventBatch` is array-like (`[ts, [events...], dp_rank?]`, the rank left
out when None), each event a map tagged with its class name (`"type": "BlockStored"`), fields
with defaults left out when they hold them. A field vLLM adds later is ignored by the map
decoding; an event type it adds fails the batch (DecodeError), which the subscriber treats as a
lost stream rather than skip what might have been a removal.

Frames on the PUB socket: (topic, seq as 8 bytes big-endian, payload). On the replay (ROUTER)
socket a client sends (b"", start seq as 8 bytes big-endian) and receives (b"", topic, seq,
payload) for every buffered batch from there, then (b"", b"", END_SEQ, b"").

Bytes in, events out: the sockets are control/fleet/kv_subscribers.py's."""

# baton: pure

from __future__ import annotations

from typing import Any

import msgspec

from control.signals.kv.index import Cleared, KvEvent, Removed, Stored

ExternalBlockHash = bytes | int
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode(payload: bytes) -> KVEventBatch:
    """One batch; msgspec.DecodeError when it is not one."""
    return _decoder.decode(payload)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _ours(medium: str | None, group_idx: int | None) -> bool:
    """The index is of the GPU prefix cache of the engine's first KV-cache group (all of a
    plain model's): offloaded tiers and a hybrid model's other groups are not indexed."""
    return medium in (None, MEDIUM_GPU) and group_idx in (None, 0)


def _keyable(ev: BlockStored) -> bool:
    """Whether a block's content is its token ids, under its adapter if any. vLLM hashes a
    LoRA adapter's name in and lists it first in each block's extra keys, so an adapter's
    block carries `(lora_name,)` there; anything more (multimodal inputs, a salt, prompt
    embeddings) is content Baton cannot key. An adapter named only by its lora_id (vLLM before
    lora_name) is not keyable either: ids are per engine, names are what clients send. No
    extra keys at all (vLLM before extra_keys) is taken as none, for an adapter's block as
    for the base's."""
    if ev.lora_name is None and ev.lora_id is not None:
        return False
    own = None if ev.lora_name is None else (ev.lora_name,)
    return ev.extra_keys is None or all(k is None or k == own for k in ev.extra_keys)


def to_events(batch: KVEventBatch) -> list[KvEvent]:
    out: list[KvEvent] = []
    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):
            out.append(Cleared())
        elif not _ours(ev.medium, ev.group_idx):
            continue
        elif isinstance(ev, BlockStored):
            out.append(Stored(tuple(ev.block_hashes), ev.parent_block_hash, tuple(ev.token_ids),
                              ev.block_size, _keyable(ev), ev.lora_name))  # fmt: skip
        else:
            out.append(Removed(tuple(ev.block_hashes)))
    return out
