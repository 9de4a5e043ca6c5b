"""The shim's front door (dataplane/edge/frontdoor.py), a process of its own that owns the port:
a request that arrives in pieces is told apart all the same (a probe answered there, anything
else served by the shim, bytes untouched), and a client that dribbles its first bytes does
not make the door spin while it waits for the rest."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from bench.cpu import cpu_seconds
from tests.integration.harness import fleet

pytestmark = pytest.mark.timeout(60)


def door_pid(shim_pid: int) -> int:
    """The shim's one child: its front door."""
    (child,) = Path(f"/proc/{shim_pid}/task/{shim_pid}/children").read_text().split()
    return int(child)


def exchange(base: str, pieces: list[bytes], pause: float) -> bytes:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        for piece in pieces:
            s.sendall(piece)
            time.sleep(pause)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_requests_in_pieces_reach_the_right_side_and_waiting_costs_nothing(
    tmp_path: Path,
) -> None:
    with fleet(tmp_path, n=1) as f:
        door = door_pid(f.shim.proc.pid)
        before = cpu_seconds(door)
        probe = [b"GET /hea", b"lth/ready HTTP/1.1\r\nHo", b"st: x\r\n\r\n"]
        reply = exchange(f.shim.ready, probe, 0.5)  # a second of dribbling
        spent = cpu_seconds(door) - before
        assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.endswith(b"\r\n\r\nready")
        assert spent < 0.2, f"the front door used {spent:.2f} s of CPU waiting for a probe"
        # Not a probe, in pieces too: the shim's HTTP server answers, with what was sent.
        models = [b"GET /v1/mo", b"dels HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"]
        reply = exchange(f.shim.ready, models, 0.2)
        assert reply.startswith(b"HTTP/1.1 200 OK") and b'"object":"list"' in reply.replace(
            b" ", b""
        )
