"""`baton up --replicas 3` as a person runs it, three times in the same directory: up, a
request through the shim, Ctrl-C; up again on the same addresses, then the whole `baton up`
SIGKILLed; up once more over what that left (etcd's data dir, its pid file, ports just freed).
Each start must serve, and nothing it started may outlive it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from clients.client import AdminClient
from clients.procs import free_ports
from tests.integration.harness import http, wait_until

pytestmark = pytest.mark.timeout(240)

REPLICAS = 3


@dataclass
class Up:
    proc: subprocess.Popen[str]
    base_url: str
    controls: str  # A,B,C as the "Baton is up" line names them
    etcd_pid: int


def _up(cwd: Path, control_port: int) -> Up:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    argv = [sys.executable, "-m", "clients.cli", "up", "--replicas", str(REPLICAS),
            "--control-listen", f"127.0.0.1:{control_port}", "--metrics-listen", "127.0.0.1:0",
            "--listen", "127.0.0.1:0", "--ready-timeout", "60"]  # fmt: skip
    with (cwd / "up.err").open("ab") as err:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err,
                                text=True)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    out = proc.stdout
    threading.Thread(target=lambda: [lines.put(t) for t in out], daemon=True).start()
    try:
        line = lines.get(timeout=90)
    except queue.Empty:
        proc.kill()
        raise AssertionError((cwd / "up.err").read_text()[-2000:]) from None
    assert line.startswith("Baton is up"), (line, (cwd / "up.err").read_text()[-2000:])
    base_url = line.split("OpenAI base URL: ")[1].split()[0]
    controls = line.rsplit("(control: ", 1)[1].rstrip(")\n")
    etcd_pid = int((cwd / ".baton" / "etcd" / "etcd.pid").read_text())
    return Up(proc, base_url, controls, etcd_pid)


def _serves(up: Up, cwd: Path) -> None:
    body = {"model": "baton-sim", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}  # fmt: skip
    status, data = http(
        "POST", up.base_url + "/chat/completions", json.dumps(body).encode(),
        {"content-type": "application/json"},
    )  # fmt: skip
    assert status == 200, data
    token = (cwd / ".baton" / "admin-token").read_text().strip()
    with AdminClient(up.controls, token=token) as admin:
        assert len(admin.list_backends()) == 3  # registered once, through the leader


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _all_gone(up: Up, ports: list[int]) -> bool:
    """etcd ended and every replica's port free again (the replicas ended)."""
    return _gone(up.etcd_pid) and free_ports(REPLICAS, first=ports[0]) == ports


def test_up_twice_then_after_a_sigkill(tmp_path: Path) -> None:
    # Below the ephemeral range, so no outgoing connection takes one between the runs.
    ports = free_ports(REPLICAS, first=20000 + os.getpid() % 10000)
    controls = ",".join(f"127.0.0.1:{p}" for p in ports)

    first = _up(tmp_path, ports[0])
    assert first.controls == controls
    _serves(first, tmp_path)
    first.proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert first.proc.wait(30) == 0
    assert _all_gone(first, ports)

    second = _up(tmp_path, ports[0])
    assert second.controls == controls  # the same addresses again
    _serves(second, tmp_path)
    second.proc.kill()
    second.proc.wait()
    # Its children are told by the kernel (parent-death signal), not by baton up.
    assert wait_until(lambda: _all_gone(second, ports), timeout=20)

    third = _up(tmp_path, ports[0])
    try:
        assert third.controls == controls
        _serves(third, tmp_path)
    finally:
        third.proc.send_signal(signal.SIGINT)
        assert third.proc.wait(30) == 0
