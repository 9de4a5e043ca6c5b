"""Baton's image run as containers with podman, on the host's network, as the deploy tests
need them: each started in the foreground, ready once it printed its READY line (as
clients.procs.Part waits for a process), SIGKILLed from outside with `podman kill`, and
removed at the end whatever happened."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from typing import IO

# This kind of machine refuses crun (its cgroup setup): runc, the host's network, and limits
# podman's defaults would exceed.
RUN_FLAGS = ("--runtime", "runc", "--network", "host",
             "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096")  # fmt: skip


def podman() -> str:
    path = shutil.which("podman")
    if path is None:
        raise RuntimeError("podman is not installed: apt-get install -y podman runc mmdebstrap")
    return path


class Container:
    """`podman run --rm IMAGE ARGS...` in the foreground: `ready` is the address on its
    `<NAME> READY <address>` line; `announced` holds the lines before it, as Part's."""

    def __init__(
        self,
        image: str,
        name: str,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        volumes: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> None:
        self.name = name
        argv = [podman(), "run", "--rm", "--name", name, *RUN_FLAGS]
        for key, value in (env or {}).items():
            argv += ["--env", f"{key}={value}"]
        for volume in volumes:
            argv += ["--volume", volume]
        self.proc = subprocess.Popen(
            [*argv, image, *args], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
        )
        self.ready = self._await_ready(timeout)

    def _await_ready(self, timeout: float) -> str:
        lines: list[str] = []
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None

        def read() -> None:
            while True:
                text = stdout.readline()
                lines.append(text)
                if not text or " READY " in text:
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        self.announced = {t.split()[1]: t.split()[-1] for t in lines[:-1] if len(t.split()) >= 3}
        last = lines[-1].strip() if lines else ""
        if " READY " not in last:
            self.remove()
            raise RuntimeError(f"container {self.name} did not start: {last!r}")
        return last.rsplit(" ", 1)[1]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the container's process from outside, as a node losing it would."""
        subprocess.run([podman(), "kill", "--signal", "KILL", self.name],
                       capture_output=True, timeout=30, check=False)  # fmt: skip

    def remove(self) -> None:
        """Gone, whatever its state: the container forced out, the foreground podman reaped."""
        subprocess.run([podman(), "rm", "--force", "--time", "0", "--ignore", self.name],
                       capture_output=True, timeout=60, check=False)  # fmt: skip
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def run(
    image: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """A one-off command in the image (the admin CLI), removed when it exits."""
    argv = [podman(), "run", "--rm", *RUN_FLAGS]
    for key, value in (env or {}).items():
        argv += ["--env", f"{key}={value}"]
    return subprocess.run([*argv, image, *args], capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
