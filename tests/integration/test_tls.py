"""gRPC over TLS: control serves with a certificate; the CLI and a shim that trust its CA talk
to it, and a plaintext client is refused. The certificate is self-signed, made here, for
127.0.0.1 (subjectAltName IP), with the openssl command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from baton.frames import frame
from baton.v1 import routing_pb2, routing_pb2_grpc
from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    http,
    metric,
    start_control,
    start_shim,
    start_sim,
    write_config,
)


def self_signed(dir: Path) -> tuple[Path, Path]:
    cert, key = dir / "cert.pem", dir / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=baton-test",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@dataclass(frozen=True)
class TlsFleet:
    control: str
    shim: str
    ca: Path


def cli(
    control: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args, "--control", control, "--timeout", "3"],
        capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.fixture(scope="module")
def tls_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsFleet]:
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(tmp)
    parts: list[Part] = []
    try:
        sim = start_sim()
        parts.append(sim)
        config = write_config(tmp / "control.toml", [("s0", sim.ready)])
        control = start_control(config, "--tls-cert", str(cert), "--tls-key", str(key))
        parts.append(control)
        shim = start_shim(control.ready, "--control-tls-ca", str(cert))
        parts.append(shim)
        yield TlsFleet(control.ready, shim.ready, cert)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def test_the_cli_talks_tls_with_the_ca_from_a_flag_or_the_environment(tls_fleet: TlsFleet) -> None:
    control, cert = tls_fleet.control, tls_fleet.ca
    out = cli(control, "backends", "list", "--json", "--tls-ca", str(cert))
    assert out.returncode == 0, out.stderr
    assert [r["id"] for r in json.loads(out.stdout)] == ["s0"]
    out = cli(control, "status", env={"BATON_TLS_CA": str(cert)})
    assert out.returncode == 0 and "toy" in out.stdout, out.stderr


def test_a_plaintext_client_is_refused(tls_fleet: TlsFleet) -> None:
    out = cli(tls_fleet.control, "backends", "list", env={"BATON_TLS_CA": ""})
    assert out.returncode == 1
    assert "cannot reach the control plane" in out.stderr and "TLS" in out.stderr


def test_a_shim_routes_through_a_tls_control(tls_fleet: TlsFleet) -> None:
    shim = tls_fleet.shim
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    status, data = http("POST", shim + "/v1/completions", json.dumps(body).encode(),
                        {"Content-Type": "application/json"})  # fmt: skip
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"]
    _, models = http("GET", shim + "/v1/models")
    assert [m["id"] for m in json.loads(models)["data"]] == [MODEL]  # from the TLS snapshot
    # Its routes ride control's route socket, over TLS with the same CA.
    assert metric(shim, "baton_shim_route_socket") == 1


def test_the_route_socket_refuses_plaintext(tls_fleet: TlsFleet) -> None:
    creds = grpc.ssl_channel_credentials(tls_fleet.ca.read_bytes())
    with grpc.secure_channel(tls_fleet.control, creds) as channel:
        watch = routing_pb2_grpc.RoutingServiceStub(channel).WatchSnapshots(
            routing_pb2.WatchSnapshotsRequest(), timeout=10
        )
        port = next(iter(watch)).route_port
    assert port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(frame(routing_pb2.RouteSocketHello(authorization="Bearer plain")))
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:
            answer = b""
    assert answer == b"", "a plaintext hello got an answer from a TLS route socket"
