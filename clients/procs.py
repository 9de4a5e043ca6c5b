"""Start a Baton part (control, shim, sim) as a child process and wait for its READY line.
Used by `baton up`, the integration tests and the benchmarks, so all run the real thing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol


def signal_group(proc: subprocess.Popen[str] | subprocess.Popen[bytes], sig: int) -> None:
    """Signal `proc`'s process group (it was started in a session of its own); after a
    SIGKILL, wait for it, so its port and pid are free on return."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        proc.wait()


class StartFailed(RuntimeError):
    pass


class Child(Protocol):
    """What `baton up` watches and stops at the end: a Part, or its EtcdServer."""

    name: str

    @property
    def alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    def stop(self, grace: float = 5.0) -> int | None: ...


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (a child told to bind it may still lose a race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def free_ports(n: int, host: str = "127.0.0.1", first: int = 0) -> list[int]:
    """n consecutive free ports, the lowest run at or above `first`; `first` 0: any n free
    ports. Checked as gRPC binds (SO_REUSEADDR): a port the last run's connections left in
    TIME_WAIT counts as free, so a restarted `baton up` gets the same ports again."""
    if first == 0:
        return [free_port(host) for _ in range(n)]
    base = first
    while base + n <= 65536:
        taken = next((p for p in range(base, base + n) if not _bindable(host, p)), None)
        if taken is None:
            return list(range(base, base + n))
        base = taken + 1
    raise StartFailed(f"no {n} consecutive free ports from {first} on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


_PR_SET_PDEATHSIG = 1


def term_on_parent_death() -> None:
    """In the child before exec: SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Part:
    """`ready` is the address the part printed on its `<NAME> READY <address>` line."""

    def __init__(
        self,
        name: str,
        module_argv: Sequence[str],
        *,
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
        stderr: int | None = None,
        die_with_parent: bool = False,
    ) -> None:
        """`die_with_parent`: the part gets SIGTERM when this process dies, however it
        dies (Linux): a SIGKILLed `baton up` leaves no orphan holding its ports."""
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *module_argv],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **(env or {})},
            # Own process group: Ctrl-C reaches the parent, which stops parts in order.
            start_new_session=True,
            preexec_fn=term_on_parent_death if die_with_parent else None,  # noqa: PLW1509
        )
        self.ready = self._await_ready(timeout)

    def _await_ready(self, timeout: float) -> str:
        """Reads lines up to the READY one; earlier lines (e.g. `CONTROL METRICS <url>`)
        are kept in `announced`."""
        line: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None  # noqa: S101 - we asked for a pipe

        def read() -> None:
            while True:
                text = stdout.readline()
                line.append(text)
                if not text or " READY " in text:
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        self.announced = {t.split()[1]: t.split()[-1] for t in line[:-1] if len(t.split()) >= 3}
        text = line[-1].strip() if line else ""
        if " READY " not in text:
            self.kill()
            raise StartFailed(f"{self.name} did not start (exit {self.proc.poll()}): {text!r}")
        return text.rsplit(" ", 1)[1]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group, so an engine's children die with it."""
        if self.alive:
            signal_group(self.proc, sig)
        elif sig == signal.SIGKILL:
            self.proc.wait()

    def stop(self, grace: float = 5.0) -> int:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode
