"""`baton control --config FILE --listen HOST:PORT`"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from baton import aio
from baton.tokens import ADMIN_ENV, SHIM_ENV, SHIM_FILE_ENV, TokenError, shim_token
from control import config as config_mod
from control.exceptions import ConfigError
from control.server import ControlPlane

log = logging.getLogger("baton.control")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML file with [[backends]] and settings")
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT for gRPC")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("BATON_DATA_DIR") or None,
        help="where the audit log and the fleet database (backends, drains and pairs changed "
        "at run time) are kept across restarts (env BATON_DATA_DIR; none: memory only)",
    )
    parser.add_argument(
        "--no-fleet-db",
        action="store_true",
        help="keep only the audit log in --data-dir, not the fleet (nor tenants' spend): for "
        "a fleet registered anew at every start (baton up's embedded sims), which a saved one "
        "would collide with",
    )
    parser.add_argument(
        "--tls-cert", type=Path, help="PEM certificate chain: serve gRPC over TLS (with --tls-key)"
    )
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument(
        "--shim-token-file",
        type=Path,
        default=os.environ.get(SHIM_FILE_ENV) or None,
        metavar="FILE",
        help=f"the token shims must present to the routing service (or env {SHIM_ENV}; "
        f"env {SHIM_FILE_ENV}); required when {ADMIN_ENV} is set",
    )
    parser.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9464",
        help="HOST:PORT for Prometheus /metrics ('' = off)",
    )
    parser.add_argument(
        "--routing",
        default=os.environ.get("ROUTING"),
        help="routing policy (overrides the config; env ROUTING)",
    )
    parser.add_argument(
        "--route-port",
        default="0",
        help="port of the route socket, on --listen's host: shims' routes and outcomes without "
        "gRPC's per-message cost (0: any free port, told to shims in each snapshot; 'off': "
        "none, shims route over gRPC). Behind a proxy or a Kubernetes Service, give it a "
        "fixed port and expose it next to --listen's",
    )
    parser.add_argument(
        "--store",
        help="etcd://HOST:PORT[,HOST:PORT...]: run as one of several control replicas on etcd "
        "(the configuration is kept there, not in --data-dir's fleet.db; one replica leads)",
    )
    parser.add_argument("--store-prefix", default="/baton", help="the key prefix in etcd")
    parser.add_argument(
        "--replica-id", default="", help="this replica's name (default: its address)"
    )
    parser.add_argument(
        "--advertise",
        default="",
        help="HOST:PORT where shims and the CLI reach this replica (default: --listen's)",
    )
    parser.add_argument(
        "--lease-ttl",
        type=int,
        default=1,
        help="seconds of the leader's etcd lease: a dead leader is replaced within about this "
        "(etcd grants at least its own minimum: 1 s with --election-timeout 500, else 2 s)",
    )
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")


def _tokens(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(admin token, shim token). Either both services are guarded or, with neither token,
    both are open (a machine of one's own): an admin token alone would leave the routing
    service, which can demote the whole fleet, open to anyone who reaches the port."""
    admin = os.environ.get(ADMIN_ENV) or None
    try:
        shim = shim_token(args.shim_token_file)
    except TokenError as exc:
        raise ConfigError(str(exc)) from None
    if admin and not shim:
        raise ConfigError(
            f"{ADMIN_ENV} is set but no shim token is: the routing service (whose reports "
            f"demote backends and fill the audit log) would be open to anyone who reaches "
            f"control. Set {SHIM_ENV} or --shim-token-file for control and every shim "
            f"(baton up generates one)"
        )
    if admin and admin == shim:
        raise ConfigError(
            f"{ADMIN_ENV} and the shim token are the same: give shims a token of their own, "
            f"so that a shim's credential cannot change the fleet"
        )
    if shim and not admin:
        log.warning("no %s: the admin service is open to anyone who reaches control", ADMIN_ENV)
    if not admin and not shim:
        log.warning(
            "no %s and no %s: the admin and routing services are open to anyone who reaches "
            "control (fine on a machine of one's own; see docs/operations.md#security)",
            ADMIN_ENV, SHIM_ENV,
        )  # fmt: skip
    return admin, shim


def _tls(args: argparse.Namespace) -> tuple[bytes, bytes] | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        return None
    try:
        return args.tls_cert.read_bytes(), args.tls_key.read_bytes()
    except OSError as exc:
        raise ConfigError(f"TLS: {exc}") from None


def _route_port(value: str) -> int | None:
    if value == "off":
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"--route-port: {value!r} is neither a port (0-65535) nor 'off'")
    return port


CLOCK_OFFSET_ENV = "BATON_CLOCK_OFFSET_S"


def _clock() -> Callable[[], float]:
    """Control's wall clock; BATON_CLOCK_OFFSET_S seconds ahead of the machine's when set
    (a drill or a test that must see a budget's period end without waiting for it)."""
    raw = os.environ.get(CLOCK_OFFSET_ENV, "")
    try:
        offset = float(raw) if raw else 0.0
    except ValueError:
        raise ConfigError(f"{CLOCK_OFFSET_ENV}: {raw!r} is not a number of seconds") from None
    if not math.isfinite(offset):
        raise ConfigError(f"{CLOCK_OFFSET_ENV}: {raw!r} is not a number of seconds")
    return (lambda: time.time() + offset) if offset else time.time


async def _serve(
    args: argparse.Namespace,
    cfg: config_mod.Config,
    tls: tuple[bytes, bytes] | None,
    tokens: tuple[str | None, str | None],
) -> int:
    plane = ControlPlane(
        cfg,
        args.listen,
        clock=_clock(),
        metrics_listen=args.metrics_listen or None,
        data_dir=args.data_dir,
        keep_fleet=not args.no_fleet_db,
        admin_token=tokens[0],
        shim_token=tokens[1],
        tls=tls,
        route_port=_route_port(args.route_port),
        store=args.store,
        store_prefix=args.store_prefix,
        replica_id=args.replica_id,
        advertise=args.advertise,
        lease_ttl=args.lease_ttl,
    )
    port = await plane.start()
    host = args.listen.rsplit(":", 1)[0]
    if plane.metrics_port:
        metrics_host = args.metrics_listen.rsplit(":", 1)[0]
        print(f"CONTROL METRICS http://{metrics_host}:{plane.metrics_port}/metrics", flush=True)
    print(f"CONTROL READY {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await plane.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = config_mod.load(args.config)
        if args.routing:
            cfg = config_mod.with_routing(cfg, args.routing)
        tls = _tls(args)
        tokens = _tokens(args)
    except ConfigError as exc:
        print(f"baton control: {exc}", file=sys.stderr)
        return 2
    try:
        return aio.run(_serve(args, cfg, tls, tokens))
    except ConfigError as exc:  # e.g. an unreadable fleet database in --data-dir
        print(f"baton control: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton control")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
