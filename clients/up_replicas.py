"""The control replicas of `baton up --replicas N`: a local etcd (clients/etcd_server.py)
and N replicas on it (`baton control --store etcd://...`, docs/replicas.md) on consecutive
ports, and the embedded sims registered through whichever replica leads."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from clients.client import AdminClient, AdminError
from clients.etcd_server import EtcdServer
from clients.procs import Child, Part, free_ports


def start_replicas(
    args: argparse.Namespace,
    has_backends: bool,
    tokens: dict[str, str],
    children: list[Child],
) -> list[Part]:
    """etcd, then the replicas c0..c{N-1}, each with its own data dir (its audit log; the
    configuration is in etcd). etcd is children[0], so it is stopped last: replicas give up
    their leases while it still answers."""
    host, port = args.control_listen.rsplit(":", 1)
    ports = free_ports(args.replicas, host, int(port))
    metrics = _metrics_listens(args.metrics_listen, args.replicas)
    etcd = EtcdServer(
        _etcd_dir(args, ports[0]),
        timeout=args.ready_timeout,
        # The embedded sims are registered anew at every start (new ports): etcd's copy of
        # the last run's fleet would collide with them (as --no-fleet-db avoids for SQLite).
        fresh=not has_backends or not args.data_dir,
        die_with_parent=True,
    )
    children.append(etcd)
    etcd.start()
    replicas = []
    for i, (listen_port, metrics_listen) in enumerate(zip(ports, metrics, strict=True)):
        argv = ["control", "--listen", f"{host}:{listen_port}", "--metrics-listen",
                metrics_listen, "--store", etcd.store_url, "--replica-id", f"c{i}"]  # fmt: skip
        if args.data_dir:
            argv += ["--data-dir", str(Path(args.data_dir) / "replicas" / f"c{i}")]
        if args.config:
            argv += ["--config", str(args.config)]
        replica = Part(f"c{i}", argv, timeout=args.ready_timeout, env=tokens, die_with_parent=True)
        children.append(replica)
        replicas.append(replica)
    return replicas


def _etcd_dir(args: argparse.Namespace, first_port: int) -> Path:
    """Under the data dir; without one (memory only), a scratch dir wiped at every start,
    named after the first replica's port, which no other `baton up` holds meanwhile."""
    if args.data_dir:
        return Path(args.data_dir) / "etcd"
    return Path(tempfile.gettempdir()) / f"baton-{os.getuid()}-etcd-{first_port}"


def _metrics_listens(listen: str, n: int) -> list[str]:
    """--metrics-listen for each replica: off for all, any free port for each, or n
    consecutive free ports from the given one."""
    if not listen:
        return [""] * n
    host, port = listen.rsplit(":", 1)
    if port == "0":
        return [listen] * n
    return [f"{host}:{p}" for p in free_ports(n, host, int(port))]


# The refusals that pass once a leader is elected, or another replica leads.
_UNTIL_LEADER = ("FAILED_PRECONDITION", "UNAVAILABLE", "DEADLINE_EXCEEDED", "cannot reach")


def register_with_leader(
    args: argparse.Namespace, control_at: str, sims: list[Part], token: str | None
) -> None:
    """The sims registered as with one control, through whichever replica leads (AdminClient
    follows the leader a refusal names). Until the first leader is elected, about one lease
    after the start, every replica refuses: tried again until --ready-timeout. ALREADY_EXISTS
    after a failed attempt: that attempt was applied and its answer lost (the lead moved)."""
    deadline = time.monotonic() + args.ready_timeout
    with AdminClient(control_at, token=token or "") as admin:
        for i, sim in enumerate(sims):
            failed = False
            while True:
                try:
                    admin.add_backend(f"sim-{i}", sim.ready, args.sim_model, "vllm", "serve")
                    break
                except AdminError as exc:
                    if failed and str(exc).startswith("ALREADY_EXISTS"):
                        break
                    if not str(exc).startswith(_UNTIL_LEADER) or time.monotonic() > deadline:
                        raise
                    failed = True
                    time.sleep(0.2)
