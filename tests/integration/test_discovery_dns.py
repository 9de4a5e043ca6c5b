"""Discovery from DNS through real processes: a real dnsmasq on 127.0.0.1 (a free port, no
daemon, no upstream resolver) answers a name's A records from a hosts file it re-reads on
SIGHUP, and static SRV records; control re-resolves the name and engines (sims) join as
records appear and leave as they go. Needs dnsmasq (`apt-get install dnsmasq`): marker
`deploy`, run by `make test-deploy`."""

from __future__ import annotations

import getpass
import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dns.resolver
import pytest

from clients.client import AdminClient
from clients.procs import Part, free_port
from tests.integration.harness import (
    FAST_SIM,
    MODEL,
    http,
    metric,
    start_control,
    start_shim,
    wait_until,
    write_config,
)

pytestmark = [
    pytest.mark.deploy,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("dnsmasq") is None, reason="needs dnsmasq"),
]

NAME = "engines.test"
SRV = f"_http._tcp.{NAME}"


@contextmanager
def dnsmasq(
    tmp_path: Path, hosts: str, *extra: str
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """dnsmasq answering for .test from `hosts` (an /etc/hosts-style file; SIGHUP re-reads
    it): a name it does not list is NXDOMAIN, as a cluster's DNS answers for its domain."""
    path = tmp_path / "hosts"
    path.write_text(hosts)
    port = free_port()
    proc = subprocess.Popen(["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null",
                             "--no-resolv", "--no-hosts", f"--addn-hosts={path}",
                             "--listen-address=127.0.0.1", "--bind-interfaces", f"--port={port}",
                             "--pid-file=", f"--user={getpass.getuser()}", "--local-ttl=0",
                             "--local=/test/",
                             *extra])  # fmt: skip
    try:
        r = dns.resolver.Resolver(configure=False)
        r.nameservers, r.port, r.lifetime = ["127.0.0.1"], port, 0.5

        def answers() -> bool:
            try:
                r.resolve("nothing.test", "A")
            except dns.resolver.NXDOMAIN:
                return True
            except dns.exception.DNSException:
                return False
            return True

        assert wait_until(answers, 10), "dnsmasq did not answer"
        yield proc, port, path
    finally:
        proc.terminate()
        proc.wait(5)


def records(path: Path, proc: subprocess.Popen[bytes], *hosts: str) -> None:
    path.write_text("".join(f"{h} {NAME}\n" for h in hosts))
    proc.send_signal(signal.SIGHUP)


@contextmanager
def discovered(tmp_path: Path, source: str) -> Iterator[tuple[Part, Part]]:
    parts: list[Part] = []
    try:
        config = write_config(tmp_path / "control.toml", [], extra=source)
        parts.append(start_control(config))
        parts.append(start_shim(parts[0].ready))
        yield parts[0], parts[1]
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def ids(control: Part) -> dict[str, str]:
    with AdminClient(control.ready, timeout=10.0) as admin:
        return {b.id: b.source for b in admin.list_backends()}


def complete(shim: Part) -> int:
    status, _ = http("POST", shim.ready + "/v1/completions",
                     json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4}).encode(),
                     {"Content-Type": "application/json"})  # fmt: skip
    return status


def sim_on(host: str, port: int) -> Part:
    return Part("sim", ["sim", "--listen", f"{host}:{port}", "--model", MODEL, *FAST_SIM])


def test_a_records_added_and_removed(tmp_path: Path) -> None:
    """Two engines on one port, at 127.0.0.2 and 127.0.0.3, as a headless Service's pods."""
    port = free_port("127.0.0.2")
    sims = [sim_on("127.0.0.2", port), sim_on("127.0.0.3", port)]
    one, two = (f"{NAME}/127.0.0.{i}:{port}" for i in (2, 3))
    try:
        with dnsmasq(tmp_path, f"127.0.0.2 {NAME}\n") as (proc, dns_port, hosts):
            source = (f'[[discovery.dns]]\nname = "{NAME}"\nport = {port}\ninterval = 0.2\n'
                      f'nameserver = "127.0.0.1:{dns_port}"\n')  # fmt: skip
            with discovered(tmp_path, source) as (control, shim):
                assert wait_until(lambda: ids(control) == {one: f"dns:{NAME}"}, 20)
                assert complete(shim) == 200
                records(hosts, proc, "127.0.0.2", "127.0.0.3")
                assert wait_until(lambda: set(ids(control)) == {one, two}, 20)
                records(hosts, proc, "127.0.0.3")
                assert wait_until(lambda: set(ids(control)) == {two}, 20)
                before = metric(sims[0].ready, "vllm:prompt_tokens_total")
                assert all(complete(shim) == 200 for _ in range(4))
                assert metric(sims[0].ready, "vllm:prompt_tokens_total") == before
                records(hosts, proc)  # the name lists nothing now
                assert wait_until(lambda: ids(control) == {}, 20)
    finally:
        for s in sims:
            s.stop(grace=3)


def test_srv_records_name_each_engines_port(tmp_path: Path) -> None:
    sims = [sim_on("127.0.0.1", 0), sim_on("127.0.0.1", 0)]
    ports = [int(s.ready.rsplit(":", 1)[1]) for s in sims]
    srv = [f"--srv-host={SRV},e{i}.{NAME},{p}" for i, p in enumerate(ports)]
    targets = [f"--host-record=e{i}.{NAME},127.0.0.1" for i in range(2)]
    try:
        with dnsmasq(tmp_path, "", *srv, *targets) as (_, dns_port, _):
            source = (f'[[discovery.dns]]\nname = "{SRV}"\nrecord = "SRV"\ninterval = 0.2\n'
                      f'nameserver = "127.0.0.1:{dns_port}"\n')  # fmt: skip
            with discovered(tmp_path, source) as (control, shim):
                want = {f"{SRV}/127.0.0.1:{p}" for p in ports}
                assert wait_until(lambda: set(ids(control)) == want, 20)
                assert complete(shim) == 200
    finally:
        for s in sims:
            s.stop(grace=3)
