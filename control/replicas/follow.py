"""Soft state from the leader to its followers (proto/baton/v1/replica.proto): each follower
holds one Follow stream to the leader; the leader sends it its soft state as it is (a dump),
then every change, batched every BATCH_S. A change is an op (control/fleet/journal.py).

Ops are recorded only while some follower listens, so a single control, or a leader alone,
pays nothing. A follower that falls behind by more than MAX_QUEUED batches is dropped and
reconnects (getting a fresh dump): a slow follower never grows the leader's memory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
import msgspec

from baton.v1 import replica_pb2, replica_pb2_grpc
from control.fleet.journal import Op, dump, replay
from control.fleet.registry import Registry

log = logging.getLogger("baton.control.replicas")

BATCH_S = 0.05
DUMP_BATCH = 5_000  # ops per message of the dump
MAX_QUEUED = 400  # batches a follower may be behind (20 s of changes) before it is dropped
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class SoftStateServicer(replica_pb2_grpc.ReplicaServiceServicer):
    """The leader's side."""

    def __init__(self, registry: Registry, term: Callable[[], int]) -> None:
        self._registry = registry
        self._term = term  # the leader's term now; 0: it does not lead
        self._ops: list[Op] = []
        self._followers: set[asyncio.Queue[replica_pb2.FollowResponse | None]] = set()

    @property
    def followers(self) -> int:
        return len(self._followers)

    def flush(self) -> None:
        """Sends what changed since the last flush to every follower (the batching task
        calls this every BATCH_S)."""
        if not self._ops:
            return
        # The journal is this list's own append: empty it in place, never replace it.
        ops = self._ops.copy()
        self._ops.clear()
        batch = replica_pb2.FollowResponse(term=self._term(), ops=[_encode(op) for op in ops])
        for q in list(self._followers):
            if q.qsize() >= MAX_QUEUED:
                log.warning("a follower replica fell %d batches behind: dropped", MAX_QUEUED)
                self._drop(q)
                q.put_nowait(None)
            else:
                q.put_nowait(batch)

    def stop(self) -> None:
        """This replica stopped leading: every follower's stream ends."""
        for q in list(self._followers):
            self._drop(q)
            q.put_nowait(None)

    def _drop(self, q: asyncio.Queue[replica_pb2.FollowResponse | None]) -> None:
        self._followers.discard(q)
        if not self._followers:
            self._registry.journal_to(None)
            self._ops.clear()

    async def Follow(
        self, request: replica_pb2.FollowRequest, context: object
    ) -> AsyncIterator[replica_pb2.FollowResponse]:
        term = self._term()
        # What others were sent already goes first, so that this follower's dump is exactly
        # the state after it, and nothing in it is applied twice.
        self.flush()
        ops = [_encode(op) for op in dump(self._registry)]
        q: asyncio.Queue[replica_pb2.FollowResponse | None] = asyncio.Queue()
        self._followers.add(q)
        self._registry.journal_to(self._ops.append)
        log.info("replica %s follows (%d ops of soft state)", request.replica_id, len(ops))
        try:
            for i in range(0, max(len(ops), 1), DUMP_BATCH):
                last = i + DUMP_BATCH >= len(ops)
                yield replica_pb2.FollowResponse(term=term, ops=ops[i : i + DUMP_BATCH],
                                                 caught_up=last)  # fmt: skip
            while (batch := await q.get()) is not None:
                yield batch
        finally:
            self._drop(q)


async def follow(
    address: str,
    me: str,
    registry: Registry,
    metadata: tuple[tuple[str, str], ...],
    *,
    tls_ca: bytes | None = None,
) -> None:
    """A follower's side: replays the leader's soft state on `registry` until the stream
    ends (the leader stopped leading or died) or the caller cancels. `tls_ca`: the leader
    serves TLS, its certificate signed by this (PEM)."""
    if tls_ca is not None:
        opened = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(tls_ca))
    else:
        opened = grpc.aio.insecure_channel(address)
    async with opened as channel:
        stub = replica_pb2_grpc.ReplicaServiceStub(channel)
        term = 0  # the leader's, as its first batch said
        async for batch in stub.Follow(replica_pb2.FollowRequest(replica_id=me),
                                       metadata=metadata):  # fmt: skip
            if not batch.term or (term and batch.term != term):
                return  # its term ended (a leader whose lease just ran out): not applied
            if not term:
                term = batch.term
                # The new leader's in-flight requests replace what the last one had.
                registry.clear_load()
            for raw in batch.ops:
                with contextlib.suppress(TypeError, ValueError, IndexError):
                    replay(registry, _decode(raw))
