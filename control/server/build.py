"""The control plane's parts as configured: the audit log, the registry, the gRPC server."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.v1 import admin_pb2, admin_pb2_grpc, routing_pb2, routing_pb2_grpc
from control.api.admin import AdminServicer
from control.api.routing import RoutingServicer
from control.audit.durable import EventFile
from control.audit.log import Entry, EventLog
from control.config import Config
from control.fleet.db import Configured, fleet, prices, shadowed, shadowed_tenants, tenants
from control.fleet.owners import OwnerTable
from control.fleet.pins import PinTable
from control.fleet.prices import shadowed_prices
from control.fleet.registry import Registry
from control.fleet.sources import CLI

log = logging.getLogger("baton.control")

ROUTING_SERVICE = routing_pb2.DESCRIPTOR.services_by_name["RoutingService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
# A follower replica reports these NOT_SERVING: shims and the CLI look for the one serving.
GATED_SERVICES = (ROUTING_SERVICE, ADMIN_SERVICE)


def registry_for(
    config: Config, saved: Configured, clock: Callable[[], float], events: EventLog
) -> Registry:
    """The fleet as configured, with what operators changed at run time laid over it."""
    backends = fleet(config.backends, saved)
    return Registry(
        backends,
        sources={b.id: CLI for b in backends if b not in config.backends},
        drained=saved.drained,
        clock=clock,
        health_policy=config.health,
        events=events,
        pins=PinTable(config.affinity.pin_capacity, config.affinity.pin_ttl),
        owners=OwnerTable(config.affinity.owner_capacity, config.affinity.owner_ttl),
        kv_capacity=config.kv.capacity,
        tenants=tenants(config.tenants, saved),
        adapters=config.adapters,
        prices=prices(config.prices, saved),
    )


def event_log(
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


def warn_shadowed(config: Config, saved: Configured, data_dir: Path | None) -> None:
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
    changed = [(m, "set") for m in shadowed_prices(config.prices, saved.prices)]
    changed += [(m, "unset") for m in sorted(saved.prices_unset & set(config.prices.prices))]
    for model, how in changed:
        log.warning(
            "price of %r: %s at run time (saved in %s), which replaces the config file's "
            "[prices.%r]: run-time changes are the operator's latest word. `baton prices set` "
            "changes it again.", model, how, data_dir / "fleet.db" if data_dir else "fleet.db",
            model,
        )  # fmt: skip


def add_services(
    server: grpc.aio.Server, routing: RoutingServicer, admin: AdminServicer
) -> health.aio.HealthServicer:
    """Routing, admin, health and reflection on `server`; the health servicer, whose
    statuses are set once the server listens."""
    routing_pb2_grpc.add_RoutingServiceServicer_to_server(routing, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        ROUTING_SERVICE,
        ADMIN_SERVICE,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    return health_servicer


def listen(server: grpc.aio.Server, address: str, tls: tuple[bytes, bytes] | None) -> int:
    """The port `server` listens on at `address` (over TLS with `tls`: chain, key)."""
    if tls is not None:
        cert, key = tls
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port
