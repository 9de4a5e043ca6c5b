"""Wiring of the control plane: grpc.aio server with routing, admin, health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import aiohttp
import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baton.model import Backend, BackendId, Role
from baton.tracing import tracing_from_env
from baton.v1 import admin_pb2, admin_pb2_grpc, replica_pb2_grpc, routing_pb2, routing_pb2_grpc
from control.api import auth
from control.api.admin import AdminServicer
from control.api.leader_gate import LeaderGate, Standalone
from control.api.leader_gate import Replica as ReplicaPart
from control.api.route_socket import RouteSocket
from control.api.routing import RoutingServicer
from control.audit.durable import EventFile
from control.audit.log import Entry, EventLog
from control.audit.payloads import PairChange
from control.config import Config
from control.exceptions import RegistryError
from control.fleet.db import (
    Configured,
    FleetDB,
    configured,
    fleet,
    shadowed,
    shadowed_tenants,
    tenants,
)
from control.fleet.kv_subscribers import KvSubscribers
from control.fleet.load_poller import run_load_poller
from control.fleet.owners import OwnerTable
from control.fleet.pins import PinTable
from control.fleet.prober import run_prober
from control.fleet.registry import Registry
from control.metrics import ControlMetrics, ReplicaCollector
from control.pairs.flow import PairFlow
from control.replicas.election import Member
from control.replicas.reconcile import reconcile
from control.replicas.replica import Replica
from control.routing.policy import SpillGuard, make_policy
from control.routing.router import Router
from control.settings import PairSpec
from control.signals.facts import Facts
from control.signals.published import fetch_facts

log = logging.getLogger("baton.control")
QUEUE_TICK_S = 0.05
# A follower replica reports these NOT_SERVING: shims and the CLI look for the one serving.
_GATED_SERVICES = (
    routing_pb2.DESCRIPTOR.services_by_name["RoutingService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
)


def _registry(
    config: Config, saved: Configured, clock: Callable[[], float], events: EventLog
) -> Registry:
    """The fleet as configured, with what operators changed at run time laid over it."""
    return Registry(
        fleet(config.backends, saved),
        drained=saved.drained,
        clock=clock,
        health_policy=config.health,
        events=events,
        pins=PinTable(config.affinity.pin_capacity, config.affinity.pin_ttl),
        owners=OwnerTable(config.affinity.owner_capacity, config.affinity.owner_ttl),
        kv_capacity=config.kv.capacity,
        tenants=tenants(config.tenants, saved),
    )


def _event_log(
    file: EventFile | None,
    clock: Callable[[], float],
    replica_sink: Callable[[Entry], None] | None = None,
) -> EventLog:
    """The audit log, written through to `file` and restored from it when there is one; a
    control replica's events also go to etcd (`replica_sink`)."""
    if replica_sink is not None:
        if file is None:
            return EventLog(clock, sink=replica_sink)
        append = file.append

        def both(entry: Entry) -> None:
            append(entry)
            replica_sink(entry)

        return EventLog(clock, sink=both, restored=file.load(100_000), durable=file.flush)
    if file is None:
        return EventLog(clock)
    return EventLog(clock, sink=file.append, restored=file.load(100_000), durable=file.flush)


def _warn_shadowed(config: Config, saved: Configured, data_dir: Path | None) -> None:
    """A backend added at run time under a config file backend's id replaces it: say so, and
    how to get the file's back."""
    for b in shadowed(config.backends, saved):
        log.warning(
            "backend %r: the one added at run time (saved in %s) replaces the config "
            "file's (url %s): run-time changes are the operator's latest word. To use the "
            "file's again, re-add it with the file's fields: `baton backends remove %s`, "
            "then `baton backends add %s --url %s ...`.",
            b.id, data_dir / "fleet.db" if data_dir else "", b.url, b.id, b.id, b.url,
        )  # fmt: skip
    for t in shadowed_tenants(config.tenants, saved):
        db = data_dir / "fleet.db" if data_dir else "fleet.db"
        log.warning(
            "tenant %r: the one changed at run time (saved in %s) replaces the config file's: "
            "run-time changes are the operator's latest word, so the file's entry for it "
            "(priority, limits, key_sha256) is not used. To use the file's again, stop "
            "control and run: sqlite3 %s \"DELETE FROM tenants WHERE id = '%s'\"",
            t.id, db, db, t.id,
        )  # fmt: skip


class _Part(ReplicaPart, Protocol):
    """A replica's part as control asks it: the routing service's, and its events' sink."""

    def record(self, entry: Entry) -> None: ...


class _Standalone(Standalone):
    def record(self, entry: Entry) -> None:
        return None


_STANDALONE = _Standalone()


class _Joined:
    """The part of a replica that joined its group (control/replicas/replica.py)."""

    def __init__(self, replica: Replica, clock: Callable[[], float]) -> None:
        self._replica = replica
        self._clock = clock

    @property
    def leading(self) -> bool:
        return self._replica.leading

    def refusal(self) -> tuple[str, str]:
        return self._replica.refusal()

    async def sync(self) -> None:
        await self._replica.sync()

    async def own(self, key: str, backend_id: str, model: str, released: bool) -> None:
        await self._replica.own(key, backend_id, model, self._clock(), released)

    def record(self, entry: Entry) -> None:
        self._replica.record(entry)


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
        rng = random.Random(seed)
        # The audit log survives restarts when there is a data dir to keep it in.
        self._event_file = EventFile(data_dir / "events.jsonl") if data_dir else None
        self._clock = clock
        self._store = store
        self._store_prefix = store_prefix
        self._replica_id = replica_id
        self._advertise = advertise
        self._lease_ttl = lease_ttl
        self.replica: Replica | None = None
        self._part: _Part = _STANDALONE
        events = _event_log(self._event_file, clock, self._to_replica if store else None)
        # What operators changed at run time (backends, drains, pairs) survives a restart; a
        # replica keeps it in etcd instead.
        self._db = FleetDB(data_dir / "fleet.db") if data_dir and keep_fleet and not store else None
        saved = self._db.load() if self._db else Configured()
        _warn_shadowed(config, saved, data_dir)
        self.registry = _registry(config, saved, clock, events)
        # Each engine's KV-cache events, for registered backends with `kv_events`.
        self.kv = KvSubscribers(self.registry, config.kv)
        # The one pair flow over the registry: router, services, metrics and _save share it.
        self.pairs = PairFlow(self.registry)
        guard = SpillGuard(config.affinity.spill_factor, config.affinity.spill_slack)
        self.router = Router(
            self.registry,
            make_policy(config.routing, guard),
            rng=rng,
            clock=clock,
            route_events=config.audit.route_events,
            pairs=self.pairs,
            stale_after=config.load.stale_after,
            admission=config.admission,
        )
        self._config = config
        # Configured and previously bound pairs, bound as soon as both sides' facts are read.
        self._pending_pairs = list({p.draft: p for p in (*config.pairs, *saved.pairs)}.values())
        self._listen = listen
        self._tls = tls  # (certificate chain PEM, private key PEM): gRPC over TLS
        self._shim_token = shim_token
        self._route_port = route_port
        self._route_socket: RouteSocket | None = None
        self._rng = rng
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
        self.metrics = ControlMetrics(
            self.registry, self.pairs, clock, queued=self.router.queued_by_band
        )
        self.tracing = tracing_from_env("baton-control")
        self._metrics_listen = metrics_listen
        self._metrics_runner: web.AppRunner | None = None
        self.metrics_port = 0
        self._http: aiohttp.ClientSession | None = None

    async def read_facts(self, backend: Backend, within: float) -> Facts:
        assert self._http is not None, "read_facts before start()"
        return await fetch_facts(self._http, backend, within)

    # -- a replica's part, as control/api/leader_gate.py and the routing service ask it ----
    # (STANDALONE until this control joins its group, and for good when it is no replica)

    @property
    def leading(self) -> bool:
        return self._part.leading

    def refusal(self) -> tuple[str, str]:
        return self._part.refusal()

    async def sync(self) -> None:
        await self._part.sync()

    async def own(self, key: str, backend_id: str, model: str, released: bool) -> None:
        await self._part.own(key, backend_id, model, released)

    def _to_replica(self, entry: Entry) -> None:
        self._part.record(entry)

    def _apply(self, configured: Configured) -> None:
        """The registry brought to the configuration in etcd (a replica)."""
        wanted = reconcile(
            self.registry, self.pairs, configured, config_backends=self._config.backends,
            config_tenants=self._config.tenants, config_pairs=self._config.pairs,
        )  # fmt: skip
        pending = {p.draft: p for p in self._pending_pairs}
        pending.update((p.draft, p) for p in wanted)
        self._pending_pairs = list(pending.values())
        if self._pending_pairs and (self._binding is None or self._binding.done()):
            self._binding = asyncio.get_running_loop().create_task(self._bind_pending_pairs())

    def _role(self, leading: bool) -> None:
        log.warning("replica %s: %s", self._replica_id, "leads" if leading else "follows")
        if self._routing is not None:
            self._routing.role_changed()
        if not leading and self._route_socket is not None:
            self._route_socket.drop_all()
        if self._health is not None:
            status = (health_pb2.HealthCheckResponse.SERVING if leading
                      else health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip
            for name in _GATED_SERVICES:
                self._tasks.append(asyncio.create_task(self._health.set(name, status)))

    async def start(self) -> int:
        self._http = aiohttp.ClientSession()
        routing = RoutingServicer(self.router, self.metrics, self.read_facts, self.tracing,
                                  replica=self)  # fmt: skip
        self._routing = routing
        routing_pb2_grpc.add_RoutingServiceServicer_to_server(routing, self.server)
        status = self._replica_status if self._store else None
        admin_pb2_grpc.add_AdminServiceServicer_to_server(
            AdminServicer(self.router, self.read_facts, on_changed=self._save, status=status),
            self.server,
        )
        health_servicer = health.aio.HealthServicer()
        self._health = health_servicer
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        names = (
            routing_pb2.DESCRIPTOR.services_by_name["RoutingService"].full_name,
            admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        if self._tls is not None:
            cert, key = self._tls
            creds = grpc.ssl_server_credentials([(key, cert)])
            self.port = self.server.add_secure_port(self._listen, creds)
        else:
            self.port = self.server.add_insecure_port(self._listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {self._listen}")
        if self._store:
            await self._join(self._store)
        await self.server.start()
        if self._route_port is not None:
            self._route_socket = RouteSocket(routing.answer, self._shim_token, self._tls)
            host = self._listen.rpartition(":")[0].strip("[]")
            routing.route_port = await self._route_socket.start(host, self._route_port)
        for name in names[:2] + ("",):
            serving = self.replica is None or name not in _GATED_SERVICES
            await health_servicer.set(
                name,
                health_pb2.HealthCheckResponse.SERVING if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )  # fmt: skip
        self._tasks.append(
            asyncio.create_task(
                run_prober(
                    self.registry, self._config.probes, self._rng, self._http, self._wants_facts
                )  # fmt: skip
            )
        )
        if self._config.load.interval > 0:
            poll = run_load_poller(self.registry, self._config.load, self._http, self._clock)
            self._tasks.append(asyncio.create_task(poll))
        self.kv.start()
        self._tasks.append(asyncio.create_task(self._expire_load()))
        self._tasks.append(asyncio.create_task(self._flush_events()))
        if self._config.admission.enabled:
            self._tasks.append(asyncio.create_task(self._drain_queue(routing)))
        if self._pending_pairs and self._binding is None:
            self._binding = asyncio.create_task(self._bind_pending_pairs())
        if self.replica is not None:
            self.replica.start()
        if self._metrics_listen:
            self.metrics_port = await self._serve_metrics(self._metrics_listen)
        return self.port

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
        self.replica = Replica(
            url, self._store_prefix, me, self._lease_ttl, self.registry,
            apply=self._apply, adopt=self.registry.events.adopt, on_role=self._role,
            metadata=metadata, owner_ttl=self._config.affinity.owner_ttl,
            # With TLS, a follower checks the leader's certificate against the chain it
            # serves itself: the replicas share a certificate, or a chain ending in the CA.
            tls_ca=self._tls[0] if self._tls else None,
        )  # fmt: skip
        replica = self.replica
        self._part = _Joined(replica, self._clock)
        self.metrics.registry.register(
            ReplicaCollector(lambda: replica.leading, lambda: replica.election.store_ok,
                             lambda: replica.soft.followers)
        )  # fmt: skip
        self._apply(await self.replica.load(timeout=30.0))
        replica_pb2_grpc.add_ReplicaServiceServicer_to_server(self.replica.soft, self.server)

    async def _replica_status(self, resp: admin_pb2.GetStatusResponse) -> None:
        if self.replica is not None:
            await self.replica.status(resp)

    async def _serve_metrics(self, listen: str) -> int:
        """Prometheus scrapes control over plain HTTP on its own port."""
        registry = self.metrics.registry

        async def scrape(request: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        app = web.Application()
        app.router.add_get("/metrics", scrape)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        host, _, port = listen.rpartition(":")
        site = web.TCPSite(self._metrics_runner, host or "127.0.0.1", int(port))
        await site.start()
        return int(self._metrics_runner.addresses[0][1])

    def _wants_facts(self, backend: Backend) -> bool:
        """Whether a pair may need this backend's facts: a draft, a configured pair's
        target, or a backend of a model some pair serves (the draft may be re-bound to it)."""
        if backend.role is Role.DRAFT or any(s.target == backend.id for s in self._pending_pairs):
            return True
        return any(p.model == backend.model for p in self.pairs)

    async def _bind_pending_pairs(self) -> None:
        """Bind each pending pair once control has read both backends' facts (the prober's
        refresher reads them as backends answer); a refusal is an audit event, not a crash."""
        reg = self.registry
        while self._pending_pairs:
            waiting = []
            for spec in self._pending_pairs:
                draft, target = (
                    reg.facts.get(BackendId(spec.draft)),
                    reg.facts.get(BackendId(spec.target)),
                )
                if draft is None or target is None:
                    waiting.append(spec)
                    continue
                try:
                    self.pairs.bind_pair(
                        spec.draft, spec.target, spec.num_draft_tokens, draft, target
                    )
                except RegistryError as exc:
                    log.warning("pair %s -> %s not bound: %s", spec.draft, spec.target, exc)
                    refused = PairChange(pair=spec.draft, action="refused", reason=str(exc))
                    reg.events.record(refused, backend_id=spec.target)
            self._pending_pairs = waiting
            await asyncio.sleep(0.2)

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
        bound = [PairSpec(p.draft_id, p.bound_target_id, p.num_draft_tokens) for p in self.pairs]
        known = {b.id for b in reg.backends}
        # Pairs still waiting for facts are configuration too, unless their draft is gone.
        waiting = [p for p in self._pending_pairs if p.draft in known and p.draft not in
                   {b.draft for b in bound}]  # fmt: skip
        return configured(self._config.backends, reg.backends, reg.drained(), [*waiting, *bound],
                          config_tenants=self._config.tenants,
                          current_tenants=reg.tenants.all())  # fmt: skip

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
