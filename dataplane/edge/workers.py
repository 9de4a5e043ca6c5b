"""`baton shim --workers N`: N shim processes on one port (SO_REUSEPORT, the kernel spreads
new connections over them), each with its own stream to control. One Python process serves
about one core; this is how a shim uses more.

The supervisor only starts, restarts and stops its workers: it never touches a request.
Workers stay in the supervisor's process group, so killing the group kills them all."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

log = logging.getLogger("baton.shim.workers")

# Set in a worker's environment: Ctrl-C reaches the whole process group, and the worker must
# take its stop from the supervisor alone (one SIGTERM), or it would see two signals and skip
# its grace.
WORKER_ENV = "BATON_SHIM_WORKER"
READY_TIMEOUT = 30.0
RESTART_PAUSE = 1.0  # a worker that keeps crashing is restarted at most once a second


class Worker:
    def __init__(self, index: int, argv: Sequence[str]) -> None:
        self.index = index
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dataplane", *argv],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, WORKER_ENV: str(index)},
        )
        self.ready = threading.Event()
        # Reads the READY line, then drains stdout so a chatty worker never blocks on it.
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None  # noqa: S101 - we asked for a pipe
        for line in self.proc.stdout:
            if " READY " in line:
                self.ready.set()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, SO_REUSEPORT socket: it holds the port (the OS's pick when
    `port` is 0) until the workers listen on it too. Not listening, it takes no connections."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def supervise(listen: str, n: int, argv: Sequence[str], grace: float) -> int:
    host, _, port_text = listen.rpartition(":")
    host = host or "127.0.0.1"
    try:
        holder = reserve_port(host, int(port_text))
    except OSError as exc:
        raise SystemExit(f"--listen {listen}: {exc}") from None
    port = holder.getsockname()[1]
    worker_argv = [*argv, "--listen", f"{host}:{port}", "--reuse-port"]
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pool = [Worker(i, worker_argv) for i in range(n)]
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        for w in pool:
            if not w.ready.wait(max(0.0, deadline - time.monotonic())) or stop.is_set():
                log.error("shim worker %d did not start", w.index)
                _stop_all(pool, grace=2.0)
                return 1
        holder.close()
        print(f"SHIM READY http://{host}:{port}", flush=True)
        while not stop.wait(0.5):
            for i, w in enumerate(pool):
                if not w.alive and time.monotonic() - w.started > RESTART_PAUSE:
                    log.warning("shim worker %d exited (%s); restarting", i, w.proc.returncode)
                    pool[i] = Worker(i, worker_argv)
        return _stop_all(pool, grace)
    finally:
        holder.close()
        for w in pool:
            if w.alive:
                w.proc.kill()


def _stop_all(pool: Sequence[Worker], grace: float) -> int:
    """SIGTERM each worker (each stops gracefully within `grace`); 0 when all exit 0."""
    for w in pool:
        if w.alive:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace + 10.0  # the grace, then the workers' own cleanup
    codes = []
    for w in pool:
        try:
            codes.append(w.proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            codes.append(w.proc.wait())
    return 0 if all(c == 0 for c in codes) else 1
