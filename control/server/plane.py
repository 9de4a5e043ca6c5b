"""ControlPlane: owns the server, the registry and the router over it, and the background
tasks; `start` binds, `stop` shuts down gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2

from baton.model import Backend
from baton.tracing import tracing_from_env
from baton.usage_days import DayRow, Key
from baton.v1 import admin_pb2, replica_pb2_grpc
from control.api import auth
from control.api.admin import AdminServicer
from control.api.leader_gate import LeaderGate
from control.api.route_socket import RouteSocket
from control.api.routing import RoutingServicer
from control.audit.durable import EventFile
from control.audit.log import Entry
from control.config import Config
from control.discovery.runner import Discovery
from control.fleet.db import Configured, FleetDB, configured
from control.fleet.kv_subscribers import KvSubscribers
from control.fleet.load_poller import run_load_poller
from control.fleet.prober import run_prober
from control.fleet.spend_db import SpendDB
from control.metrics import ControlMetrics, ReplicaCollector
from control.pairs.flow import PairFlow
from control.replicas.election import Member
from control.replicas.reconcile import reconcile
from control.replicas.replica import Replica
from control.routing.policy import SpillGuard, make_policy
from control.routing.router import Router
from control.server.adapters import AdapterService
from control.server.build import (
    GATED_SERVICES,
    add_services,
    event_log,
    listen,
    registry_for,
    warn_shadowed,
)
from control.server.part import ALONE, Joined, Part
from control.server.pending import PendingPairs
from control.server.scrape import serve_metrics
from control.server.spend_flush import SpendFlusher
from control.signals.facts import Facts
from control.signals.published import fetch_facts

log = logging.getLogger("baton.control")
QUEUE_TICK_S = 0.05
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ControlPlane:
    """Owns the server and background tasks; `start` binds, `stop` shuts down gracefully."""

    def __init__(
        self,
        config: Config,
        listen: str,
        *,
        metrics_listen: str | None = None,
        data_dir: Path | None = None,
        keep_fleet: bool = True,
        admin_token: str | None = None,
        shim_token: str | None = None,
        tls: tuple[bytes, bytes] | None = None,
        route_port: int | None = 0,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
        store: str | None = None,
        store_prefix: str = "/baton",
        replica_id: str = "",
        advertise: str = "",
        lease_ttl: int = 1,
    ) -> None:
        """`route_port`: where shims' routes come without gRPC (the route socket, on the gRPC
        listen host; 0: any free port, told to shims with each snapshot; None: none, and
        shims route over gRPC's RouteStream). `store`: etcd://HOST:PORT[,...]: this control
        is one replica of a group on etcd (control/replicas/), its configuration kept there
        under `store_prefix` rather than in SQLite; `replica_id` names it, `advertise` is
        where shims reach it (default: the address it listens on), `lease_ttl` its lease's
        seconds (a dead leader is replaced within about that)."""
        self._config = config
        self._clock = clock
        self._rng = random.Random(seed)
        self._store, self._store_prefix, self._lease_ttl = store, store_prefix, lease_ttl
        self._replica_id, self._advertise = replica_id, advertise
        self.replica: Replica | None = None
        # A replica's part as routing and the leader gate ask it: the null one until this
        # control joins its group, and for good when it is no replica.
        self._part: Part = ALONE
        self._build_state(config, data_dir, keep_fleet and not store)
        # Tenants' spend per budget period, kept in fleet.db a second at a time; a replica
        # keeps it in etcd instead, as often (control/replicas/spend.py, started with it).
        # Not for a fleet that is not kept either (`baton up`'s embedded sims).
        self._spend: SpendFlusher | None = None
        if data_dir is not None and keep_fleet and not store:
            ledger = self.registry.tenants.spend
            self._spend = SpendFlusher(ledger, SpendDB(data_dir / "fleet.db"), clock,
                                       self.registry.tenants.days)  # fmt: skip
            self._spend.restore()
        self._listen = listen
        self._tls = tls  # (certificate chain PEM, private key PEM): gRPC over TLS
        self._shim_token = shim_token
        self._route_port = route_port
        self._route_socket: RouteSocket | None = None
        interceptors: list[grpc.aio.ServerInterceptor] = [
            *auth.interceptors(admin_token, shim_token)
        ]
        if store:
            interceptors.append(LeaderGate(self))
        self.server = grpc.aio.server(interceptors=interceptors)
        self._routing: RoutingServicer | None = None
        self._health: health.aio.HealthServicer | None = None
        self._binding: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port = 0
        self.tracing = tracing_from_env("baton-control")
        self._metrics_listen = metrics_listen
        self._metrics_runner: web.AppRunner | None = None
        self.metrics_port = 0
        self._http: aiohttp.ClientSession | None = None
        # Engines found in the cluster (control/discovery/); None without [discovery] sources.
        self.discovery: Discovery | None = None
        if config.discovery.sources:
            self.discovery = Discovery(self.registry, config.discovery, rng=self._rng,
                                       leading=lambda: self.leading, http=self._session)

    def _build_state(self, config: Config, data_dir: Path | None, keep_fleet: bool) -> None:
        """The audit log, the registry with what operators changed at run time laid over the
        configuration, the pair flow, the router and the metrics over them."""
        # The audit log survives restarts when there is a data dir to keep it in.
        self._event_file = EventFile(data_dir / "events.jsonl") if data_dir else None
        events = event_log(self._event_file, self._clock,
                           self._to_replica if self._store else None)  # fmt: skip
        # What operators changed at run time (backends, drains, pairs) survives a restart; a
        # replica keeps it in etcd instead.
        self._db = FleetDB(data_dir / "fleet.db") if data_dir and keep_fleet else None
        saved = self._db.load() if self._db else Configured()
        warn_shadowed(config, saved, data_dir)
        self.registry = registry_for(config, saved, self._clock, events)
        # Each engine's KV-cache events, for registered backends with `kv_events`.
        self.kv = KvSubscribers(self.registry, config.kv)
        # The one pair flow over the registry: router, services, metrics and _save share it.
        self.pairs = PairFlow(self.registry)
        guard = SpillGuard(config.affinity.spill_factor, config.affinity.spill_slack)
        self.router = Router(
            self.registry, make_policy(config.routing, guard), clock=self._clock,
            route_events=config.audit.route_events, pairs=self.pairs,
            stale_after=config.load.stale_after, admission=config.admission,
            lora=config.lora,
        )  # fmt: skip
        # Configured and previously bound pairs, bound as soon as both sides' facts are read.
        self._pending = PendingPairs(self.registry, self.pairs, (*config.pairs, *saved.pairs))
        self.metrics = ControlMetrics(
            self.registry, self.pairs, self._clock, queued=self.router.queued_by_band
        )
        # LoRA adapters: the loads the router orders, an operator's, and what engines hold.
        self.adapters = AdapterService(self.registry, config.lora, self.metrics, self._clock)
        self.adapters.router = self.router
        self.router.adapters.start_load = self.adapters.order

    def _session(self) -> aiohttp.ClientSession:
        assert self._http is not None, "discovery before start()"
        return self._http

    async def read_facts(self, backend: Backend, within: float) -> Facts:
        assert self._http is not None, "read_facts before start()"
        return await fetch_facts(self._http, backend, within)

    # -- a replica's part, as control/api/leader_gate.py and the routing service ask it ----

    @property
    def leading(self) -> bool:
        return self._part.leading

    def refusal(self) -> tuple[str, str]:
        return self._part.refusal()

    async def sync(self) -> None:
        await self._part.sync()

    async def own(self, key: str, backend_id: str, model: str, released: bool) -> None:
        await self._part.own(key, backend_id, model, released)

    async def stored_days(
        self, first: str, last: str, after: Key | None, limit: int
    ) -> list[DayRow]:
        """A replica's use per day as etcd has it (control/api/admin_usage.py)."""
        if self.replica is None:
            return []
        return await self.replica.days.stored_days(first, last, after, limit)

    def _to_replica(self, entry: Entry) -> None:
        self._part.record(entry)

    def _apply(self, configured: Configured) -> None:
        """The registry brought to the configuration in etcd (a replica)."""
        wanted = reconcile(
            self.registry, self.pairs, configured, config_backends=self._config.backends,
            config_tenants=self._config.tenants, config_pairs=self._config.pairs,
            config_prices=self._config.prices,
        )  # fmt: skip
        self._pending.add(wanted)
        if self._pending and (self._binding is None or self._binding.done()):
            self._binding = asyncio.get_running_loop().create_task(self._pending.bind())

    def _role(self, leading: bool) -> None:
        log.warning("replica %s: %s", self._replica_id, "leads" if leading else "follows")
        if self._routing is not None:
            self._routing.role_changed()
        if not leading and self._route_socket is not None:
            self._route_socket.drop_all()
        if leading and self.discovery is not None:
            self.discovery.poke()  # a new leader acts on what it already sees
        if self._health is not None:
            status = SERVING if leading else NOT_SERVING
            for name in GATED_SERVICES:
                self._tasks.append(asyncio.create_task(self._health.set(name, status)))

    async def start(self) -> int:
        self._http = aiohttp.ClientSession()
        routing = RoutingServicer(self.router, self.metrics, self.read_facts, self.tracing,
                                  replica=self)  # fmt: skip
        self._routing = routing
        self.adapters.on_answers = routing.drain
        status = self._replica_status if self._store else None
        admin = AdminServicer(self.router, self.read_facts, on_changed=self._save, status=status,
                              adapters=self.adapters,
                              stored_days=self if self._store else self._spend)  # fmt: skip
        self._health = add_services(self.server, routing, admin)
        self.port = listen(self.server, self._listen, self._tls)
        if self._store:
            await self._join(self._store)
        await self.server.start()
        if self._route_port is not None:
            self._route_socket = RouteSocket(routing.answer, self._shim_token, self._tls)
            host = self._listen.rpartition(":")[0].strip("[]")
            routing.route_port = await self._route_socket.start(host, self._route_port)
        for name in (*GATED_SERVICES, ""):
            serving = self.replica is None or name not in GATED_SERVICES
            await self._health.set(name, SERVING if serving else NOT_SERVING)
        self._start_tasks(self._http, routing)
        if self.replica is not None:
            self.replica.start()
        if self._metrics_listen:
            self._metrics_runner, self.metrics_port = await serve_metrics(
                self.metrics.registry, self._metrics_listen
            )
        return self.port

    def _start_tasks(self, http: aiohttp.ClientSession, routing: RoutingServicer) -> None:
        prober = run_prober(
            self.registry, self._config.probes, self._rng, http, self._pending.wants_facts
        )
        self._tasks.append(asyncio.create_task(prober))
        if self._config.load.interval > 0:
            poll = run_load_poller(self.registry, self._config.load, http, self._clock)
            self._tasks.append(asyncio.create_task(poll))
        self.kv.start()
        watch = self.adapters.start(http)
        if watch is not None:
            self._tasks.append(watch)
        self._tasks.append(asyncio.create_task(self._expire_load()))
        if self.discovery is not None:
            self._tasks += [asyncio.create_task(t) for t in self.discovery.tasks()]
        self._tasks.append(asyncio.create_task(self._flush_events()))
        if self._spend is not None:
            self._tasks.append(asyncio.create_task(self._spend.run()))
        # Queued requests, and requests waiting for an adapter's load (adapters may be found
        # on the engines at any time).
        self._tasks.append(asyncio.create_task(self._drain_queue(routing)))
        if self._pending and self._binding is None:
            self._binding = asyncio.create_task(self._pending.bind())

    async def _join(self, url: str) -> None:
        """As a replica: the configuration in etcd (waiting for etcd a while), then the
        soft-state service for followers; campaigning starts with the other tasks."""
        host = self._listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
        address = self._advertise or f"{host}:{self.port}"
        if not self._advertise and host in ("0.0.0.0", "::"):  # noqa: S104 - a check, no bind
            log.warning(
                "--listen %s with no --advertise: other replicas and the shims are told to "
                "find this one at %s; give --advertise HOST:PORT they can reach", self._listen,
                address,
            )  # fmt: skip
        me = Member(self._replica_id or address, address)
        self._replica_id = me.id
        metadata = (("authorization", f"Bearer {self._shim_token}"),) if self._shim_token else ()
        self.replica = replica = Replica(
            url, self._store_prefix, me, self._lease_ttl, self.registry,
            apply=self._apply, adopt=self.registry.events.adopt, on_role=self._role,
            metadata=metadata, owner_ttl=self._config.affinity.owner_ttl,
            # With TLS, a follower checks the leader's certificate against the chain it
            # serves itself: the replicas share a certificate, or a chain ending in the CA.
            tls_ca=self._tls[0] if self._tls else None, clock=self._clock,
        )  # fmt: skip
        self._part = Joined(replica, self._clock)
        self.metrics.registry.register(
            ReplicaCollector(lambda: replica.leading, lambda: replica.election.store_ok,
                             lambda: replica.soft.followers)
        )  # fmt: skip
        self._apply(await replica.load(timeout=30.0))
        replica_pb2_grpc.add_ReplicaServiceServicer_to_server(replica.soft, self.server)

    async def _replica_status(self, resp: admin_pb2.GetStatusResponse) -> None:
        if self.replica is not None:
            await self.replica.status(resp)

    async def _save(self) -> None:
        """After an operator's change: the configuration as it is now, in one transaction
        (a few rows; admin changes are rare and never on the routing path). A replica writes
        it to etcd, or undoes the change and raises StoreError."""
        if self.replica is not None:
            await self.replica.commit(self._configured())
        elif self._db is not None:
            self._db.save(self._configured())

    def _configured(self) -> Configured:
        reg = self.registry
        # What discovery found is its sources' to find again, never configuration.
        operated = [b for b in reg.backends if not reg.discovered(b.id)]
        return configured(self._config.backends, operated, reg.drained(),
                          self._pending.configured(), config_tenants=self._config.tenants,
                          current_tenants=reg.tenants.all(), config_prices=self._config.prices,
                          current_prices=reg.tenants.prices)  # fmt: skip

    async def _flush_events(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self._event_file is not None:
                self._event_file.flush()

    async def _drain_queue(self, routing: RoutingServicer) -> None:
        """Room can free without a message from a shim (a load reading, a backend back), and
        a wait can reach its bound: the queue is looked at this often too."""
        while True:
            await asyncio.sleep(QUEUE_TICK_S)
            if self.router.waiting:
                routing.drain()

    async def _expire_load(self) -> None:
        while True:
            await asyncio.sleep(30)
            now = self._clock()
            self.registry.expire_load(now)
            self.router.adapters.forget_stale({rid for rid, _, _ in self.registry.held()})
            self.registry.placement.expire_pins(now)

    async def stop(self, grace: float = 2.0) -> None:
        if self.replica is not None:
            await self.replica.stop()  # a leader hands over at once
        if self._binding is not None:
            self._tasks.append(self._binding)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.kv.stop()
        if self._route_socket is not None:
            await self._route_socket.stop()
        await self.server.stop(grace)
        if self._http is not None:
            await self._http.close()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        self.tracing.shutdown()  # flush the last spans
        if self._event_file is not None:
            self._event_file.close()
        if self._db is not None:
            self._db.close()
        if self._spend is not None:
            self._spend.close()
