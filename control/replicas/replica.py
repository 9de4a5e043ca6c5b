"""One control replica's part in a group on etcd (`baton control --store etcd://...`): it
campaigns for leadership (election.py), keeps its registry at the configuration in etcd
(store.py, reconcile.py), writes the leader's low-rate events to etcd, and follows the
leader's soft state (follow.py) until it leads itself. Tenants' spend is in that stream,
and the leader writes it to etcd a second at a time (spend.py), with their use per model and
day (usage.py).

Every replica probes the backends, reads their load and subscribes to their KV events itself
(control/server.py starts those as for a single control), so a new leader's health, load and
KV index are its own and warm; pins, owners, in-flight requests and tenants' use come from
the old leader's stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import grpc

from baton.model import BackendId
from baton.replicas import not_leader
from baton.v1 import admin_pb2
from control.audit.log import Entry, Event
from control.exceptions import ConfigError, NotLeader, StoreUnavailable
from control.fleet.db import Configured
from control.fleet.registry import Registry
from control.replicas.election import Election, Member
from control.replicas.etcd import Etcd, EtcdUnavailable, parse_endpoints
from control.replicas.follow import BATCH_S, SoftStateServicer, follow
from control.replicas.spend import SpendWriter
from control.replicas.store import Owner, ReplicaStore, decode
from control.replicas.usage import DaysWriter

log = logging.getLogger("baton.control.replicas")

ROLE_CHECK_S = 0.02  # how often the role is looked at (a lease can run out between calls)
EVENTS_FLUSH_S = 0.2
EVENTS_HELD = 10_000  # events kept for etcd while it does not answer; older ones go first
FOLLOW_RETRY_S = 0.1
OWNER_LEASE_EVERY_S = 3600.0


class Replica:
    def __init__(
        self,
        url: str,
        prefix: str,
        me: Member,
        lease_ttl: int,
        registry: Registry,
        *,
        apply: Callable[[Configured], None],
        adopt: Callable[[list[Event]], int],
        on_role: Callable[[bool], None],
        metadata: tuple[tuple[str, str], ...] = (),
        owner_ttl: float = 86_400.0,
        tls_ca: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`apply(configured)`: bring the registry to it (reconcile). `adopt(events)`: merge
        events another replica recorded into this one's log. `on_role(leading)`: the role
        changed (serve as leader, or refuse and close shims' streams). `metadata`: what this
        replica presents to the leader's Follow (the shim token). `clock`: control's (its
        tenants' spend periods are on it)."""
        self.etcd = Etcd(parse_endpoints(url))
        self.store = ReplicaStore(self.etcd, prefix)
        self.me = me
        self.election = Election(
            self.etcd,
            self.store.leader_key,
            self.store.replicas_prefix,
            me,
            lease_ttl,
            on_lead=self._on_lead,
        )
        self.soft = SoftStateServicer(registry, lambda: self.election.term)
        self.spend = SpendWriter(registry.tenants.spend, self.etcd, self.store.prefix,
                                 self.store.leader_key, lambda: self.election.term,
                                 clock)  # fmt: skip
        self.days = DaysWriter(registry.tenants.days, self.etcd, self.store.prefix,
                               self.store.leader_key, lambda: self.election.term,
                               clock)  # fmt: skip
        self._registry = registry
        self._apply = apply
        self._adopt = adopt
        self._on_role = on_role
        self._metadata = metadata
        self._tls_ca = tls_ca  # the replicas serve TLS: the leader's certificate's CA
        self.committed = Configured()  # the configuration as etcd last had it
        self._events: list[Event] = []
        self._flushing = asyncio.Lock()
        # Stored responses' owners on their way to etcd, and the lease they go on: one an
        # hour, living the owner TTL past it, so etcd forgets an owner when control would.
        self._owners: list[Owner | str] = []
        self._owning = asyncio.Lock()
        self._owner_ttl = owner_ttl
        self._owner_lease = (0, 0.0)  # (id, when granted, monotonic)
        self._tasks: list[asyncio.Task[None]] = []
        self.leading_now = False  # the role as last told to on_role
        self._adopting: list[asyncio.Task[None]] = []

    # -- what the servicers ask ------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.election.leading

    def refusal(self) -> tuple[str, str]:
        """(why this replica refuses, the leader's address or "")."""
        leader = self.election.leader
        if leader is None or leader == self.me:
            return not_leader(self.me.id), ""
        return not_leader(self.me.id, leader.id, leader.address), leader.address

    def record(self, entry: Entry) -> None:
        """The audit log's sink: the leader's events but routing decisions go to etcd."""
        if type(entry) is Event and self.election.term:
            self._events.append(entry)
            if len(self._events) > EVENTS_HELD:
                del self._events[: len(self._events) - EVENTS_HELD]

    async def status(self, resp: admin_pb2.GetStatusResponse) -> None:
        resp.replica_id = self.me.id
        leader = self.election.leader
        if leader == self.me and not self.leading:
            leader = None  # its lease ran out by its clock: who leads is not known here
        resp.leader = leader.id if leader else ""
        try:
            members = await asyncio.wait_for(self.election.members(), 1.0)
        except (EtcdUnavailable, TimeoutError):
            members = [self.me] + ([leader] if leader and leader != self.me else [])
        for m in sorted(members, key=lambda m: m.id):
            resp.replicas.add(id=m.id, address=m.address, leader=leader == m)
        why = self.election.store_error
        resp.store = f"{self.store.url}: {'ok' if not why else 'unreachable (' + why + ')'}"

    async def commit(self, configured: Configured) -> None:
        """Writes the configuration, fenced by this replica's term; on any failure the
        registry goes back to what etcd holds, and StoreError says why."""
        term = self.election.term
        try:
            if not term or not self.leading:
                raise NotLeader(self.refusal()[0])
            await self.store.save(configured, term)
        except EtcdUnavailable as exc:
            self._apply(self.committed)
            raise StoreUnavailable(f"{exc}: the change was not made") from None
        except Exception:
            self._apply(self.committed)
            raise
        self.committed = configured

    # -- life ------------------------------------------------------------------------------

    async def load(self, timeout: float) -> Configured:
        """The configuration in etcd at start, waiting up to `timeout` for etcd; and the
        tenants' spend and today's use per model there."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                configured, _ = await self.store.load()
                await self.spend.restore()
                await self.days.restore()
                self.committed = configured
                return configured
            except EtcdUnavailable as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise ConfigError(f"--store: {exc}") from None
                await asyncio.sleep(0.2)

    def start(self) -> None:
        for job in (
            self.election.run(),
            self._watch_config(),
            self._watch_role(),
            self._flush_events(),
            self._follow_leader(),
            self._batch_soft_state(),
            self.spend.run(),
            self.days.run(),
        ):
            self._tasks.append(asyncio.create_task(job))

    async def stop(self) -> None:
        for t in [*self._tasks, *self._adopting]:
            t.cancel()
        for t in [*self._tasks, *self._adopting]:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.soft.stop()
        if self.election.term:
            # Hand over at once rather than after the lease's TTL.
            with contextlib.suppress(EtcdUnavailable, grpc.aio.AioRpcError):
                await self._flush()
            with contextlib.suppress(EtcdUnavailable, grpc.aio.AioRpcError):
                await self.spend.flush()  # the last second's spend too
            with contextlib.suppress(EtcdUnavailable, grpc.aio.AioRpcError):
                await self.days.flush()
            await self.election.resign()
        await self.etcd.close()

    async def _on_lead(self, term: int) -> None:
        """Elected: read the configuration as it is now (at least as new as the election),
        and any spend (and today's use) etcd holds more of than the stream brought, before
        serving as leader."""
        configured, _ = await self.store.load()
        if configured != self.committed:
            self._apply(configured)
            self.committed = configured
        await self.spend.restore()
        await self.days.restore()
        loop = asyncio.get_running_loop()
        self._adopting = [
            loop.create_task(self._adopt_events()),
            loop.create_task(self._adopt_owners()),
        ]

    async def _adopt_events(self) -> None:
        try:
            events = await self.store.load_events()
        except EtcdUnavailable as exc:
            log.warning("the last leader's events could not be read: %s", exc)
            return
        log.info("took %d earlier events from etcd", self._adopt(events))

    async def _watch_role(self) -> None:
        while True:
            leading = self.election.leading
            if leading != self.leading_now:
                self.leading_now = leading
                if not leading:
                    self.soft.stop()
                self._on_role(leading)
            await asyncio.sleep(ROLE_CHECK_S)

    async def _watch_config(self) -> None:
        """Every replica keeps its registry at the configuration in etcd (the leader's own
        writes come back too, and change nothing)."""
        while True:
            try:
                kv, revision = await self.etcd.get(self.store.config_key)
                if kv is not None:
                    self._changed(kv.value, kv.mod_revision)
                async for batch in self.etcd.watch(self.store.config_key, revision + 1):
                    for kind, kv in batch:
                        if kind == "put":
                            self._changed(kv.value, kv.mod_revision)
            except EtcdUnavailable:
                await asyncio.sleep(0.2)

    def _changed(self, raw: bytes, revision: int) -> None:
        if revision <= self.store.revision or self.election.term:
            return
        try:
            configured = decode(raw)
        except ConfigError as exc:
            log.error("replica %s: %s; keeping the configuration it has", self.me.id, exc)
            return
        self.store.revision = revision
        if configured != self.committed:
            self._apply(configured)
            self.committed = configured

    async def own(self, key: str, backend_id: str, model: str, at: float, released: bool) -> None:
        """A stored response's owner (or its release) is in etcd when this returns, or etcd
        did not answer (logged: the owner is in every replica's memory all the same)."""
        self._owners.append(key if released else Owner(key, backend_id, model, at))
        async with self._owning:
            if not self._owners or not self.election.term:
                return
            changes, term = self._owners.copy(), self.election.term
            try:
                if await self.store.write_owners(changes, await self._lease_for_owners(), term):
                    del self._owners[: len(changes)]
                else:
                    self._owners.clear()  # no longer the leader
            except EtcdUnavailable as exc:
                del self._owners[: max(0, len(self._owners) - EVENTS_HELD)]
                log.warning("stored responses' owners not written: %s", exc)

    async def _lease_for_owners(self) -> int:
        lease, granted = self._owner_lease
        now = asyncio.get_running_loop().time()
        if not lease or now - granted > OWNER_LEASE_EVERY_S:
            ttl = int(self._owner_ttl + OWNER_LEASE_EVERY_S)
            lease = (await self.etcd.grant(ttl))[0]
            self._owner_lease = (lease, now)
        return lease

    async def _adopt_owners(self) -> None:
        """Owners etcd holds that this replica does not (a whole group restarted, or one
        joined late): taken, so a follow-up still reaches the backend that stored it."""
        try:
            owners = await self.store.load_owners()
        except EtcdUnavailable as exc:
            log.warning("stored responses' owners could not be read: %s", exc)
            return
        placement, now = self._registry.placement, time.time()
        for o in owners:
            if placement.owner_of(o.key, now) is None:
                placement.record_owner(o.key, BackendId(o.backend_id), o.model, o.at)

    async def sync(self) -> None:
        """The leader's events so far are in etcd (or etcd does not answer): a shim's
        failover report is answered after this, so a leader killed right after loses none."""
        if not self._events:
            return
        async with self._flushing:
            with contextlib.suppress(EtcdUnavailable):
                await self._flush()

    async def _flush(self) -> None:
        if self._events and self.election.term:
            events, term = self._events.copy(), self.election.term
            if await self.store.append_events(self.me.id, events, term):
                del self._events[: len(events)]
            else:
                self._events.clear()  # no longer the leader: the new one writes its own

    async def _flush_events(self) -> None:
        while True:
            await asyncio.sleep(EVENTS_FLUSH_S)
            await self.sync()

    async def _batch_soft_state(self) -> None:
        while True:
            await asyncio.sleep(BATCH_S)
            self.soft.flush()

    async def _follow_leader(self) -> None:
        while True:
            leader = self.election.leader
            if self.election.term or leader is None or leader == self.me:
                await asyncio.sleep(FOLLOW_RETRY_S)
                continue
            task = asyncio.create_task(
                follow(
                    leader.address, self.me.id, self._registry, self._metadata, tls_ca=self._tls_ca
                )
            )
            # Until the stream ends, or this replica leads (the old leader may be stopped, its
            # stream open and silent).
            while not task.done() and not self.election.term:
                await asyncio.wait({task}, timeout=FOLLOW_RETRY_S)
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and isinstance(exc := task.exception(), grpc.aio.AioRpcError):
                log.debug("following %s: %s", leader.id, exc.code().name)
            await asyncio.sleep(FOLLOW_RETRY_S)
