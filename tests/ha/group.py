"""A group of control replicas on a real etcd, with sims and shims, for the replica tests:
real processes on 127.0.0.1 with free ports; every wait is bounded and waits on state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from baton.v1 import admin_pb2, admin_pb2_grpc, routing_pb2, routing_pb2_grpc
from clients.etcd_server import EtcdServer
from clients.procs import Part
from tests.integration.harness import (
    control_metric,
    metric,
    start_control_replica,
    start_etcd,
    start_shim,
    start_sim,
    wait_until,
    write_config,
)


@dataclass
class Group:
    etcd: EtcdServer
    config: Path
    replicas: dict[str, Part]
    sims: dict[str, Part]
    shims: list[Part] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)
    ca: Path | None = None  # the replicas serve TLS, their certificate signed by this (PEM)

    def channel(self, rid: str) -> grpc.Channel:
        address = self.replicas[rid].ready
        if self.ca is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(self.ca.read_bytes()))

    @property
    def control(self) -> str:
        """Every replica's address, as shims and the CLI take them."""
        return ",".join(p.ready for p in self.replicas.values())

    def alive(self) -> dict[str, Part]:
        return {rid: p for rid, p in self.replicas.items() if p.alive}

    def status(self, rid: str, timeout: float = 1.0) -> admin_pb2.GetStatusResponse | None:
        with self.channel(rid) as ch:
            try:
                return admin_pb2_grpc.AdminServiceStub(ch).GetStatus(
                    admin_pb2.GetStatusRequest(), timeout=timeout
                )
            except grpc.RpcError:
                return None

    def claims(self) -> list[str]:
        """The replicas that say they lead now (each answering for itself)."""
        out = []
        for rid in self.alive():
            s = self.status(rid)
            if s is not None and s.leader == s.replica_id:
                out.append(rid)
        return out

    def wait_leader(self, timeout: float = 10.0, not_: str = "") -> str:
        """The one replica leading (other than `not_`), once exactly one says so."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            claims = [c for c in self.claims() if c != not_]
            if len(claims) == 1 and self.routes(claims[0]):
                return claims[0]
            time.sleep(0.05)
        raise AssertionError(f"no single leader within {timeout}s: {self.claims()}")

    def route(
        self, rid: str, request_id: str = "probe", timeout: float = 1.0, model: str = "none"
    ) -> grpc.StatusCode:
        """A routing question to the replica: OK, or the status it refused with. For a model
        nobody serves by default: decided, and holding no backend."""
        shape = routing_pb2.RequestShape(model=model, message_count=1, prompt_chars=10)
        with self.channel(rid) as ch:
            try:
                routing_pb2_grpc.RoutingServiceStub(ch).Route(
                    routing_pb2.RouteRequest(request_id=request_id, shape=shape), timeout=timeout
                )
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]

    def routes(self, rid: str) -> bool:
        return self.route(rid) == grpc.StatusCode.OK

    def followed(self, rid: str, timeout: float = 10.0) -> bool:
        """Until every shim follows replica `rid` (its snapshots), and routes through it."""

        shims = len(self.shims)
        if not wait_until(lambda: self.metric(rid, "baton_shims_watching") == shims, timeout):
            return False
        return all(
            wait_until(lambda s=s: metric(s.ready, "baton_shim_degraded") == 0, timeout)
            for s in self.shims
        )

    def metric(self, rid: str, name: str, labels: str = "") -> float:
        """A sum over one of the replica's series (0 before its first sample)."""
        return control_metric(self.replicas[rid], name, labels)

    def baton(self, *args: str, control: str = "") -> subprocess.CompletedProcess[str]:
        """The real CLI, given every replica (or `control`)."""
        tls = ["--tls-ca", str(self.ca)] if self.ca else []
        return subprocess.run(
            [sys.executable, "-m", "clients.cli", *args, "--control", control or self.control,
             *tls],
            capture_output=True, text=True, timeout=30, env=dict(os.environ),
        )  # fmt: skip

    def stop(self, rid: str, sig: int = signal.SIGKILL) -> None:
        self.replicas[rid].kill(sig)


@contextmanager
def group(
    tmp_path: Path,
    *,
    replicas: int = 3,
    sims: int = 2,
    shims: int = 0,
    sim_args: Sequence[str] = (),
    extra: str = "",
    control_args: Sequence[str] = (),
    ca: Path | None = None,
    kv_events: bool = False,
) -> Iterator[Group]:
    """`ca`: the replicas serve TLS (control_args has --tls-cert), signed by this.
    `kv_events`: each sim publishes its KV-cache events (ZMQ), every replica subscribes."""
    parts: list[Part] = []
    etcd = start_etcd(tmp_path)
    try:
        started = {}
        for i in range(sims):
            kv = (("--kv-block-size", "8", "--kv-events-endpoint", f"ipc://{tmp_path}/s{i}.pub")
                  if kv_events else ())  # fmt: skip
            started[f"s{i}"] = start_sim(*sim_args, *kv)
        parts += started.values()
        config = write_config(
            tmp_path / "control.toml", [(k, p.ready) for k, p in started.items()], extra=extra
        )
        if kv_events:  # each backend's own endpoint
            text = config.read_text()
            for i in range(sims):
                endpoint = f'kv_events = "ipc://{tmp_path}/s{i}.pub"'
                text = text.replace(f'id = "s{i}"\n', f'id = "s{i}"\n{endpoint}\n')
            config.write_text(text)
        reps = {}
        for i in range(replicas):
            rid = f"c{i}"
            reps[rid] = start_control_replica(
                etcd, rid, *control_args, config=config, log=tmp_path / f"{rid}.log"
            )
            parts.append(reps[rid])
        g = Group(etcd, config, reps, started, parts=parts, ca=ca)
        g.wait_leader()
        for _ in range(shims):
            g.shims.append(start_shim(g.control))
            parts.append(g.shims[-1])
        yield g
    finally:
        for p in reversed(parts):
            p.stop(grace=3)
        etcd.stop()
