"""Leader election among control replicas through an etcd lease, with fencing.

Each replica holds one lease, kept alive every quarter of its TTL: its membership key
(PREFIX/replicas/ID) and, when it leads, the leader key (PREFIX/leader, created only if
absent) live on it. The leader key's create revision is the leader's *term*: every write a
leader makes compares it, so a deposed leader's write fails in etcd itself.

Routing is fenced by time. etcd expires a lease no sooner than its TTL after the last
keep-alive it answered, so a leader acts only until (when it *sent* that keep-alive) + TTL
on its own monotonic clock, which runs on while the process is stopped. A leader paused
(SIGSTOP) past its lease wakes up with that time gone: it refuses routes and writes until
etcd answers again, and etcd then says the lease is gone. The one exception: a leader whose
keep-alives fail because etcd itself does not answer keeps routing from memory (nobody can
be elected while etcd is down), and refuses admin writes, which need etcd anyway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from control.replicas import etcd
from control.replicas.etcd import Etcd, EtcdUnavailable

log = logging.getLogger("baton.control.replicas")

RETRY_S = 0.2  # between attempts while etcd is away


@dataclass(frozen=True, slots=True)
class Member:
    id: str
    address: str  # its gRPC HOST:PORT, where shims and the CLI reach it

    def to_json(self) -> bytes:
        return orjson.dumps({"id": self.id, "address": self.address})

    @classmethod
    def of(cls, raw: bytes) -> Member | None:
        try:
            d = orjson.loads(raw)
            return cls(str(d["id"]), str(d["address"]))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None


class _LeaseLost(Exception):
    pass


class Election:
    def __init__(
        self,
        client: Etcd,
        leader_key: bytes,
        replicas_prefix: bytes,
        me: Member,
        ttl: int,
        *,
        on_lead: Callable[[int], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_lead(term)`: runs once elected, before this replica serves as leader (it reads
        the configuration at least as new as its election). Who watches the role reads
        `leading`: a lease runs out between any two calls."""
        self._etcd = client
        self._key = leader_key
        self._replicas = replicas_prefix
        self.me = me
        self._ttl_asked = ttl
        self.ttl = float(ttl)
        self._on_lead = on_lead
        self._clock = clock
        self.term = 0  # the leader key's create revision while this replica leads; else 0
        self.leader: Member | None = None  # who leads, as last seen (None: nobody, unknown)
        self._valid_until = 0.0  # monotonic: this replica's lease holds until then
        self._ok_at = 0.0  # the last keep-alive etcd answered
        self._failed_at = 0.0  # the last keep-alive etcd did not answer
        self._first_failed_at = 0.0  # the first of those since the last it answered
        self.store_error = ""  # why etcd did not answer last, "" while it does
        self._lost = asyncio.Event()
        self._lease = 0

    # -- read on every route: keep it cheap ------------------------------------------------

    @property
    def leading(self) -> bool:
        if not self.term:
            return False
        now = self._clock()
        if now < self._valid_until:
            return True
        # The lease may have run out. Only an etcd that answers nobody lets us keep routing:
        # it stopped answering while the lease still held (so nobody else could be elected
        # since), and it still does not. A leader that wakes from a stop past its lease and
        # then fails to reach etcd is not one of these: its first failure came after.
        return (
            self._failed_at > self._ok_at
            and self._first_failed_at < self._valid_until
            and now - self._failed_at < self.ttl
        )

    @property
    def store_ok(self) -> bool:
        return not self.store_error

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                sent = self._clock()
                lease, granted = await self._etcd.grant(self._ttl_asked)
                self._lease = lease
                self.ttl = float(granted)
                self._valid_until = sent + granted
                self._ok_at = self._clock()
                self.store_error = ""
                self._lost.clear()
                await self._etcd.txn(
                    [], [etcd.put(self._replicas + self.me.id.encode(), self.me.to_json(), lease)]
                )
                keeper = asyncio.create_task(self._keep_alive(lease))
                try:
                    await self._campaign(lease)
                finally:
                    keeper.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await keeper
            except EtcdUnavailable as exc:
                self._failed(str(exc))
                await asyncio.sleep(RETRY_S)
            except _LeaseLost:
                log.warning("replica %s: its etcd lease expired", self.me.id)
            self._step_down()
            await self._give_back()

    async def resign(self) -> None:
        """On a clean stop: give the lease back, so another replica leads at once."""
        self._step_down()
        await self._give_back()

    async def _give_back(self) -> None:
        """The lease, and the keys on it, go now (not at its TTL): best effort."""
        lease, self._lease = self._lease, 0
        if lease:
            with contextlib.suppress(EtcdUnavailable):
                await self._etcd.revoke(lease)

    async def _keep_alive(self, lease: int) -> None:
        while True:
            await asyncio.sleep(self.ttl / 4)
            sent = self._clock()
            try:
                left = await self._etcd.keep_alive(lease, timeout=self.ttl / 2)
            except EtcdUnavailable as exc:
                self._failed(str(exc))
                continue
            if left <= 0:
                self._lost.set()
                return
            self._valid_until = sent + left
            self._ok_at = self._clock()
            if self.store_error:
                log.warning("replica %s: etcd answers again", self.me.id)
            self.store_error = ""

    def _failed(self, why: str) -> None:
        if not self.store_error:
            log.warning("replica %s: %s", self.me.id, why)
        self.store_error = why
        now = self._clock()
        if self._failed_at <= self._ok_at:
            self._first_failed_at = now  # the first failure since etcd last answered
        self._failed_at = now

    async def _campaign(self, lease: int) -> None:
        """Until the lease is lost: lead if nobody does, else follow and watch the leader."""
        while True:
            ok, resp = await self._etcd.txn(
                [etcd.compare_create(self._key, 0)],
                [etcd.put(self._key, self.me.to_json(), lease)],
                [etcd.get(self._key)],
            )
            if ok:
                await self._lead(resp.header.revision)
                await self._wait(self._lost.wait())
                raise _LeaseLost
            kvs = resp.responses[0].response_range.kvs
            if not kvs:
                continue  # deleted between the compare and the read: try again
            self.leader = Member.of(kvs[0].value)
            if self.leader is None:
                log.error("the leader key holds no replica: %r", kvs[0].value[:100])
            # (Our own key from an earlier lease, say after a restart, goes with that lease.)
            await self._wait(self._deleted(resp.header.revision + 1))

    async def _lead(self, term: int) -> None:
        log.warning("replica %s leads (term %d)", self.me.id, term)
        self.leader = self.me
        await self._on_lead(term)
        self.term = term

    async def _deleted(self, after: int) -> None:
        async for batch in self._etcd.watch(self._key, after):
            for kind, kv in batch:
                if kind == "delete":
                    return
                self.leader = Member.of(kv.value)

    async def _wait(self, what: Awaitable[object]) -> None:
        """`what`, unless the lease is lost first (then _LeaseLost)."""
        task = asyncio.ensure_future(what)
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, lost):
                t.cancel()
        if lost.done() and not lost.cancelled():
            raise _LeaseLost
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    def _step_down(self) -> None:
        if self.term:
            log.warning("replica %s no longer leads (term %d)", self.me.id, self.term)
            if self.leader == self.me:
                self.leader = None
        self.term = 0

    async def members(self) -> list[Member]:
        kvs, _ = await self._etcd.get_prefix(self._replicas)
        return [m for kv in kvs if (m := Member.of(kv.value)) is not None]
