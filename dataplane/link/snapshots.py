"""Control's snapshots as the shim keeps them: `SnapshotWatch`, one WatchSnapshots stream to
the replica the link talks to, restarted there whenever the link moves.

Its own module because the shim's view of the fleet (/v1/models, degraded routing, tenants'
keys) comes from nowhere else, and because the watch is also how a shim notices, with no
request in flight, that control went away or refused it. Each snapshot also tells where
control's route socket listens. Versions start again per replica and per restart: the watch
takes whatever control sends next after it reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

import grpc

from baton import wire
from baton.v1 import routing_pb2
from dataplane.link.leader import Target
from dataplane.link.needs import FleetView, fleet_view
from dataplane.link.outbox import not_leader

log = logging.getLogger("baton.shim.control")


class Reachability(Protocol):
    """What the watch tells of control, and waits for (dataplane/link/leader.py's Leader)."""

    up: asyncio.Event

    def poke(self) -> None: ...

    def unreachable(self, reason: str, leader: str = "", via: object = None) -> None: ...


class SocketHint(Protocol):
    """Where control's route socket listens, as its snapshots tell (RouteStream.use_socket)."""

    def __call__(self, address: tuple[str, int] | None, *, fresh: bool = False) -> None: ...


class SnapshotWatch:
    def __init__(
        self,
        control: Reachability,
        metadata: Sequence[tuple[str, str]],
        use_socket: SocketHint,
        *,
        several: bool,
    ) -> None:
        """`control`: told of each snapshot (a probe asks again at once) and of a lost watch.
        `several`: replicas to choose from, so a lost watch may mean a lost leader: find it."""
        self._control = control
        self._metadata = tuple(metadata)
        self._use_socket = use_socket
        self._several = several
        self._fleet = FleetView()
        self._first = asyncio.Event()
        self._refusal = asyncio.Event()
        self.refused: str | None = None  # control refused our credential: why
        self._task: asyncio.Task[None] | None = None

    @property
    def fleet(self) -> FleetView:
        return self._fleet

    @property
    def has_snapshot(self) -> bool:
        return self._first.is_set()

    def start(self, at: Target) -> None:
        """Watch `at` from now on (a watch elsewhere before is stopped)."""
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._watch(at))

    async def first(self, timeout: float) -> None:
        """Until the first snapshot, or control's refusal, or `timeout` seconds."""
        either = [
            asyncio.create_task(self._first.wait()),
            asyncio.create_task(self._refusal.wait()),
        ]
        await asyncio.wait(either, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for t in either:
            t.cancel()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self, at: Target) -> None:
        while True:
            why, leader, probe = "snapshot watch ended", "", self._several
            try:
                await self._follow(at)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    self._note_refusal(exc)
                    probe = False  # one token for every replica: none would take it
                else:
                    log.debug("snapshot watch: %s; reconnecting", exc.code().name)
                why = f"snapshot watch: {exc.code().name}: {exc.details()}"
                leader = not_leader(exc) or ""
            if probe:
                # Lost the leader, or it lost its lease: find it. This watch goes on once
                # the probe finds this address serving again (a move starts another).
                self._control.unreachable(why, leader, at.stub)
            await asyncio.sleep(0.5)
            if probe:
                await self._control.up.wait()

    async def _follow(self, at: Target) -> None:
        """One WatchSnapshots stream, until it ends. From version 0 each time: control
        restarts start versions again from 1, and each replica counts its own."""
        stream = at.stub.WatchSnapshots(
            routing_pb2.WatchSnapshotsRequest(after_version=0), metadata=self._metadata
        )
        fresh = True
        async for msg in stream:
            if at.host is not None:
                port = msg.route_port
                self._use_socket((at.host, port) if port else None, fresh=fresh)
                fresh = False
            self._fleet = fleet_view(wire.snapshot_from_pb(msg.snapshot))
            self._first.set()
            self._control.poke()

    def _note_refusal(self, exc: grpc.aio.AioRpcError) -> None:
        if self.refused is None:
            log.error("control refused this shim: %s", exc.details())
        self.refused = f"control refused this shim: {exc.details()}"
        self._refusal.set()
