"""Simulated engines for the chaos benchmarks, started by forking a parent that has already
imported the sim (`python -m bench.sim_zygote` is that parent; `Zygote` drives it).

A chaos run SIGKILLs a sim every ~0.4 s and restarts it, and a `python -m sim` start burns
~0.7 CPU-seconds of imports: on the benchmarks' 2-core machine that was about one core, taken
from the router whose failover gap the run measures, and absent from the floor phases. A real
fleet restarts an engine on the engine's own machine. A fork of a warm parent starts in a few
milliseconds of CPU. Each child is a real process in a session of its own, killed with
SIGKILL like any engine; nothing about serving differs from `python -m sim`.

Protocol on the parent's stdin/stdout, one spawn at a time: the caller writes a JSON argv
line; the parent answers `PID <pid>`, and the child prints `SIM READY <url>` (or
`SIM FAILED <why>`), in either order."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from clients.procs import StartFailed


def main() -> int:
    # Imported here, once: what every fork then starts with.
    from sim.__main__ import add_arguments, run

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps dead children
    print("ZYGOTE READY -", flush=True)
    for line in sys.stdin:
        argv = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            random.seed()  # not the parent's stream
            code = 1
            try:
                parser = argparse.ArgumentParser(prog="sim")
                add_arguments(parser)
                code = run(parser.parse_args(argv))
            except BaseException as exc:  # noqa: BLE001 - reported, then the child exits
                print(f"SIM FAILED {type(exc).__name__}: {exc}", flush=True)
            finally:
                sys.stdout.flush()
                os._exit(code if isinstance(code, int) else 1)
        print(f"PID {pid}", flush=True)
    return 0


class Forked:
    """A sim forked by the zygote: the `Part` interface the chaos fleet uses."""

    def __init__(self, name: str, pid: int, ready: str) -> None:
        self.name = name
        self.pid = pid
        self.ready = ready

    @property
    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)
        if sig == signal.SIGKILL:
            self._gone(5.0)

    def stop(self, grace: float = 5.0) -> None:
        self.kill(signal.SIGTERM)
        if not self._gone(grace):
            self.kill()

    def _gone(self, within: float) -> bool:
        deadline = time.monotonic() + within
        while self.alive:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


class Zygote:
    """Runs `python -m bench.sim_zygote`; `spawn` forks a sim from it."""

    def __init__(self, stderr: int | None = None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.sim_zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._lock = threading.Lock()
        first = self._next(60.0)
        if " READY " not in first:
            self.close()
            raise StartFailed(f"sim zygote did not start: {first!r}")

    def _read(self) -> None:
        assert self._proc.stdout is not None  # noqa: S101 - we asked for a pipe
        for line in self._proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("")  # EOF: the zygote is gone

    def _next(self, timeout: float) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return ""

    def spawn(self, name: str, argv: Sequence[str], timeout: float = 30.0) -> Forked:
        """A sim with these `python -m sim` arguments; StartFailed if it did not come up
        (e.g. its port is still busy)."""
        with self._lock:
            assert self._proc.stdin is not None  # noqa: S101
            self._proc.stdin.write(json.dumps(list(argv)) + "\n")
            self._proc.stdin.flush()
            pid, ready, deadline = 0, "", time.monotonic() + timeout
            while not (pid and ready):
                line = self._next(max(0.0, deadline - time.monotonic()))
                if line.startswith("PID "):
                    pid = int(line.split()[1])
                elif line.startswith("SIM READY "):
                    ready = line.rsplit(" ", 1)[1]
                elif line.startswith("SIM FAILED") or not line:
                    if pid:
                        Forked(name, pid, "").kill()
                    raise StartFailed(f"{name} did not start: {line or 'no answer'}")
            return Forked(name, pid, ready)

    def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


if __name__ == "__main__":
    sys.exit(main())
