"""Ports for `baton up --replicas N` (clients/procs.py): N consecutive ones from a given
port, passing over one that something listens on."""

from __future__ import annotations

import socket

from clients.procs import free_ports


def test_a_run_starts_past_a_port_something_listens_on() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = free_ports(2, first=port)
    assert run[0] > port
    assert run[1] == run[0] + 1


def test_first_zero_gives_any_free_ports() -> None:
    ports = free_ports(3)
    assert len(set(ports)) == 3
