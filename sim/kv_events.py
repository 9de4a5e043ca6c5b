"""Publishing KV-cache events on ZMQ, as vLLM 0.32's ZmqEventPublisher does.

One thread owns both sockets; the event loop only puts batches on a queue (never
waits: a full queue drops the batch and counts it). The thread numbers batches from
0, sends ``(topic, seq as 8 bytes big-endian, msgpack batch)`` on a PUB socket and
keeps the last ``buffer_steps`` for the ROUTER replay socket. There a client sends
``(b"", start seq as 8 bytes)`` (a DEALER; a REQ socket adds the empty frame itself)
and gets every buffered batch with ``seq >= start`` as ``(b"", topic, seq, payload)``,
then ``(b"", b"", END_SEQ, b"")``. Between batches the thread looks at the replay
socket, as vLLM's does.

The PUB endpoint is bound or connected to by vLLM's rule (``kv_wire.is_bind_endpoint``);
the replay endpoint is always bound. A bind to port 0 reports the port it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

from sim.kv_wire import END_SEQ, EventBatch, KVEventBatch, KvEventsConfig, is_bind_endpoint
from sim.kvcache import PrefixCache

log = logging.getLogger("sim.kv_events")
_POLL_S = 0.1  # how long the thread waits for a batch before it looks at replay again


def open_cache(
    capacity_blocks: int, block_size: int, kv: KvEventsConfig | None, rank: int = 0
) -> tuple[PrefixCache, KvEventPublisher | None]:
    """One engine's KV cache, and with `kv` its publisher (data-parallel rank `rank`: its
    endpoints moved as vLLM moves them, its batches stamped with the rank): the events of
    one event-loop iteration (every sequence that stepped in it: the sim's scheduler step)
    are one batch."""
    if kv is None:
        return PrefixCache(capacity_blocks, block_size), None
    try:
        kv = kv.for_rank(rank)
    except ValueError as e:
        raise SystemExit(f"kv events: {e}") from None
    try:
        pub = KvEventPublisher(kv, rank)
    except zmq.ZMQError as e:
        where = f"{kv.endpoint} / {kv.replay_endpoint}"
        who = "kv events" if rank == 0 else f"kv events (data-parallel rank {rank})"
        raise SystemExit(f"{who}: cannot open {where}: {e}") from None
    cache: PrefixCache

    def flush() -> None:
        events = cache.take_events()
        if events:
            pub.publish(KVEventBatch(ts=time.time(), events=events))

    def soon() -> None:
        try:
            asyncio.get_running_loop().call_soon(flush)
        except RuntimeError:  # no loop (a caller outside the server): publish now
            flush()

    cache = PrefixCache(capacity_blocks, block_size, events=True, on_event=soon)
    return cache, pub


class KvEventPublisher:
    """One engine's publisher; `cfg` holds its own endpoints (KvEventsConfig.for_rank)."""

    def __init__(self, cfg: KvEventsConfig, rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        self.dropped = 0  # batches the full queue refused
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self._ctx = zmq.Context()
        self._replay: zmq.Socket[bytes] | None = None
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        try:
            self._pub.set_hwm(cfg.hwm)
            if is_bind_endpoint(cfg.endpoint):
                self.endpoint = _bind(self._pub, cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
                self.endpoint = cfg.endpoint
            self.replay_endpoint: str | None = None
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _bind(self._replay, cfg.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{rank}", daemon=True)
        self._thread.start()

    def source(self) -> dict[str, object]:
        """This publisher as vLLM's GET /kv_event_sources reports one engine."""
        return self.cfg.source(self.endpoint, self.replay_endpoint)

    def publish(self, batch: EventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.rank  # vLLM's publisher stamps its DP rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seqs = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.exception("kv events: replay failed")
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(seqs)
            payload = encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                log.exception("kv events: publishing batch %d failed", seq)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: invalid replay request %r", frames)
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """Bind; with port 0, the endpoint zmq actually bound (e.g. tcp://0.0.0.0:40123)."""
    sock.bind(endpoint)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)
    return endpoint
