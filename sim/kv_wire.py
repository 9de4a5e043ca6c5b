"""vLLM 0.32's KV-cache event wire format, and its publisher's settings (pure).

The structs mirror ``vllm/distributed/kv_events.py`` field for field, with the same
msgspec options, so ``msgspec.msgpack`` writes the bytes vLLM writes:

* a batch is array-like: ``[ts, [event, ...], data_parallel_rank]`` (the rank is
  omitted only when it is None; vLLM's publisher sets it, to 0 on one engine);
* an event is a map tagged ``"type": "<class name>"``; fields with defaults are left
  out while they hold them (``omit_defaults``), required fields are always written;
* block hashes are unsigned 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the
  default); parent_block_hash is None for a chain's first block.

A ZMQ message is three frames: the topic, the batch's sequence number (8 bytes,
big-endian, from 0 per publisher start) and the msgpack batch. The replay socket
answers a start sequence number with every buffered batch from it, each as
``(topic, seq, payload)``, then ``(b"", END_SEQ, b"")``.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
# What vLLM's KVCacheManager stamps on a plain decoder's stores (KVCacheSpecKind.FULL_ATTENTION).
FULL_ATTENTION = "full_attention"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# vLLM's KVEventsConfig defaults.
DEFAULT_TOPIC = ""
BUFFER_STEPS = 10_000
HWM = 100_000
MAX_QUEUE_SIZE = 100_000


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
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
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored(
    hashes: Sequence[int], parent: int | None, token_ids: list[int], block_size: int,
    lora: tuple[int, str] | None = None,
) -> BlockStored:
    """A BlockStored as vLLM's BlockPool/KVCacheManager fill it for a plain request, or for
    one under the LoRA adapter ``lora`` = (lora_int_id, lora_name): then every block's extra
    keys are ``(lora_name,)`` (vLLM's to_event_extra_keys keeps the name of its
    ``("lora", name, path)`` key)."""
    block_hashes: list[bytes | int] = [*hashes]
    lora_id, lora_name = (None, None) if lora is None else lora
    extra: tuple[Any, ...] | None = None if lora_name is None else (lora_name,)
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=lora_id,
        medium=MEDIUM_GPU,
        lora_name=lora_name,
        extra_keys=[extra] * len(hashes),  # no multimodal, salt or embeds keys
        group_idx=0,
        kv_cache_spec_kind=FULL_ATTENTION,
    )


def removed(block_hash: int) -> BlockRemoved:
    """vLLM sends one BlockRemoved per evicted block."""
    return BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=0)


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """Where data-parallel rank `rank` publishes, given the configured endpoint: vLLM's
    ``KVEventPublisher.offset_endpoint_port``, checks in its order. Rank 0 keeps it;
    ``inproc`` gets ``_dp{rank}``; tcp moves the port up by the rank (a port of 0 stays 0:
    the OS picks each rank's); anything else (ipc) cannot be shared: ValueError."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        if ":" not in endpoint:
            return endpoint
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + rank}"
    raise ValueError(
        f"kv events endpoint {endpoint!r} cannot be moved for data-parallel rank {rank} "
        "(vLLM moves tcp ports and inproc names only)"
    )


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6 ``::`` and ipc/inproc endpoints are bound; the rest
    are connected to (the subscriber binds those)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """vLLM's --kv-events-config (publisher "zmq"), as the sim takes it."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = DEFAULT_TOPIC
    buffer_steps: int = BUFFER_STEPS
    hwm: int = HWM
    max_queue_size: int = MAX_QUEUE_SIZE

    def for_rank(self, rank: int) -> KvEventsConfig:
        """This config as data-parallel rank `rank`'s publisher takes it (endpoints moved
        by ``offset_endpoint_port``; ValueError where vLLM's raises)."""
        if rank == 0:
            return self
        replay = self.replay_endpoint
        return replace(
            self,
            endpoint=offset_endpoint_port(self.endpoint, rank),
            replay_endpoint=None if replay is None else offset_endpoint_port(replay, rank),
        )

    def source(self, endpoint: str, replay_endpoint: str | None) -> dict[str, object]:
        """One entry of vLLM's GET /kv_event_sources, with the endpoints as resolved."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
            "max_queue_size": self.max_queue_size,
            "topic": self.topic,
        }


def kv_events_from_json(raw: object) -> KvEventsConfig | None:
    """vLLM's --kv-events-config JSON; None when it leaves events off (or publisher "null")."""
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object")
    known = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
             "buffer_steps", "hwm", "max_queue_size", "topic"}  # fmt: skip
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    enabled = bool(raw.get("enable_kv_cache_events", False))
    publisher = raw.get("publisher") or ("zmq" if enabled else "null")
    if not enabled or publisher == "null":
        return None
    if publisher != "zmq":
        raise ValueError(f"unknown publisher {publisher!r} (the sim has zmq)")
    return KvEventsConfig(
        endpoint=str(raw.get("endpoint", "tcp://*:5557")),
        replay_endpoint=None if raw.get("replay_endpoint") is None else str(raw["replay_endpoint"]),
        topic=str(raw.get("topic", DEFAULT_TOPIC)),
        buffer_steps=int(raw.get("buffer_steps", BUFFER_STEPS)),
        hwm=int(raw.get("hwm", HWM)),
        max_queue_size=int(raw.get("max_queue_size", MAX_QUEUE_SIZE)),
    )
