"""Plumbing: one task per registered backend with `kv_events` (from the config file or added
at run time), subscribed to its engine's KV-cache events over ZMQ and feeding the registry's
KV index (control/signals/kv/index.py decides everything; this only moves frames).

vLLM binds its PUB (and replay ROUTER) sockets on `tcp://*:PORT` and control connects to
them: a router knows each engine's address, engines need not know control's, and a restart of
either side needs nothing of the other. A SUB socket subscribes to every topic; a gap makes
a DEALER ask the replay socket for the missed batches, waiting at most `replay_timeout`. So
does a first batch that is not the engine's first (it ran before control subscribed): a
catch-up from the start of its buffer, or what it cached before would never be credited.

A lost stream: ZMQ reconnects silently and tells a SUB nothing, so each subscription has a
socket monitor. `EVENT_DISCONNECTED` marks the index lost (what happens while disconnected is
unknown), `EVENT_HANDSHAKE_SUCCEEDED` starts it afresh. ZMTP heartbeats on the SUB socket turn
a peer that stopped answering without closing its connection (a crashed host, a partition)
into a disconnect after `heartbeat_timeout`. No staleness rule on events: vLLM publishes a
batch only when its scheduler has events (scheduler.py: `if events:`), so an idle engine is
silent and still perfectly known."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from baton.model import Backend, BackendId, Snapshot
from control.fleet.registry import Registry
from control.settings import KvSettings
from control.signals.kv import wire as kvwire
from control.signals.kv.index import Fed, KvEvent

_WATCHED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


_Source = tuple[str, str, str]  # (url, kv_events, kv_events_replay): one engine's streams


def _source(b: Backend) -> _Source:
    return b.url, b.kv_events, b.kv_events_replay


class KvSubscribers:
    """Keeps one subscriber per registered backend with `kv_events`, from each snapshot
    alone: a backend removed stops its subscriber (and its index goes), one added starts
    one, one whose url or endpoints changed starts afresh (another engine, another index)."""

    def __init__(self, registry: Registry, settings: KvSettings) -> None:
        self._registry = registry
        self._settings = settings
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[BackendId, tuple[_Source, asyncio.Task[None]]] = {}
        self._unsubscribe: Callable[[], None] = lambda: None

    def start(self) -> None:
        """Always listening, even with no backend to subscribe to yet: AddBackend may bring
        one at any time."""
        self._unsubscribe = self._registry.subscribe(self._reconcile)
        self._reconcile(self._registry.snapshot)

    def _reconcile(self, snapshot: Snapshot) -> None:
        wanted = {s.backend.id: s.backend for s in snapshot.backends if s.backend.kv_events}
        for bid in list(self._tasks):
            b = wanted.get(bid)
            if b is None or _source(b) != self._tasks[bid][0]:
                self._tasks.pop(bid)[1].cancel()
                self._registry.kv.forget(bid)
        for bid, b in wanted.items():
            if bid not in self._tasks:
                self._registry.kv.watch(bid)
                run = Subscriber(self._registry, b, self._settings, self._ctx).run()
                self._tasks[bid] = (_source(b), asyncio.get_running_loop().create_task(run))

    async def stop(self) -> None:
        self._unsubscribe()
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.destroy(linger=0)


class Subscriber:
    def __init__(
        self,
        registry: Registry,
        backend: Backend,
        settings: KvSettings,
        ctx: zmq.asyncio.Context,
    ) -> None:
        self._registry = registry
        self._endpoint, self._replay_endpoint = backend.kv_events, backend.kv_events_replay
        self._bid = backend.id
        self._settings = settings
        self._ctx = ctx

    async def run(self) -> None:
        s = self._settings
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)  # else a tcp://[::1]:PORT endpoint never connects
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(s.heartbeat * 1000)))
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(s.heartbeat_timeout * 1000)))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        monitor = sub.get_monitor_socket(_WATCHED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sub.connect(self._endpoint)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:  # before the data: a disconnect precedes what follows it
                    self._on_monitor(parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    await self._on_frames(await sub.recv_multipart())
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _on_monitor(self, msg: Mapping[str, object]) -> None:
        if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._registry.kv.connected(self._bid)
        elif msg["event"] == zmq.EVENT_DISCONNECTED:
            self._registry.kv.lost(self._bid, f"disconnected from {self._endpoint}")

    def _decode(self, frames: list[bytes]) -> tuple[int, list[KvEvent]] | None:
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames, not (topic, seq, payload)")
            return kvwire.seq_of(frames[1]), kvwire.to_events(kvwire.decode(frames[2]))
        except (ValueError, msgspec.DecodeError) as exc:
            # Skipping it could skip a removal: the index cannot vouch for itself any more.
            self._registry.kv.lost(self._bid, f"undecodable batch: {exc}")
            return None

    async def _on_frames(self, frames: list[bytes]) -> None:
        batch = self._decode(frames)
        if batch is None:
            return
        seq, events = batch
        status = self._registry.kv_status().get(self._bid)
        if status is not None and status.next_seq is None and seq > 0 and self._replay_endpoint:
            # The first batch seen, and not the engine's first: ask for what it published
            # (and so holds) before control subscribed, or its older cache is never credited.
            await self._replay(seq, catch_up=True)
            self._registry.kv.feed(self._bid, seq, events)  # a duplicate if the replay had it
        elif self._registry.kv.feed(self._bid, seq, events) is Fed.GAP:
            await self._replay(seq)
            # Applied by the replay (a duplicate now), or the first of a fresh index.
            self._registry.kv.feed(self._bid, seq, events)

    async def _replay(self, seq: int, *, catch_up: bool = False) -> None:
        """Ask for the batches before `seq`: from the one the index expects next, or (a
        catch-up) from the start of the engine's buffer."""
        status = self._registry.kv_status().get(self._bid)
        start = 0 if catch_up else status.next_seq if status is not None else None
        if start is None:
            return
        if not self._replay_endpoint:
            self._registry.kv.lost(self._bid, f"gap: seq {start}..{seq - 1} missed and no "
                                   "kv_events_replay to ask")  # fmt: skip
            return
        self._registry.kv.begin_replay(self._bid, seq)
        timeout = self._settings.replay_timeout
        try:
            async with asyncio.timeout(timeout):
                await self._fetch(start)
        except TimeoutError:
            if catch_up:  # short of `seq`: the index starts afresh there, as without one
                self._registry.kv.end_replay(self._bid, seq)
            else:
                self._registry.kv.lost(self._bid, f"replay from seq {start}: no end within "
                                       f"{timeout:g}s")  # fmt: skip
            return
        self._registry.kv.end_replay(self._bid, seq)

    async def _fetch(self, start: int) -> None:
        """Ask for every buffered batch from `start`, feeding each, up to vLLM's END_SEQ
        marker. A fresh DEALER each time: no late answer to an earlier request is read."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        try:
            dealer.connect(self._replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await dealer.recv_multipart()
                if len(frames) == 4 and frames[2] == kvwire.END_SEQ:
                    return
                batch = self._decode(frames[1:] if frames[:1] == [b""] else frames)
                if batch is None:
                    return
                if self._registry.kv.feed(self._bid, *batch) is Fed.GAP:
                    return  # the engine's buffer starts after `start`: the gap stays
        finally:
            dealer.close(linger=0)
