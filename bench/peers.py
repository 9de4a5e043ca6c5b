"""The Rust routers bench.overhead measures beside Baton: sglang-router and vllm-router, each a
Rust server behind a Python launcher, from PyPI.

They are installed on first use into the bench's own virtualenv
(`~/.cache/baton-bench/peers-venv`, or `$BATON_BENCH_CACHE/peers-venv`), never into Baton's
environment or dependencies, and started as `<venv python> -m <launcher> --worker-urls ...
--policy round_robin` on free 127.0.0.1 ports (their Prometheus port too: both default to a
fixed 29000). Anything that keeps one from running is a `NotRun` with the reason, so the bench
can say why in its table and go on with the others.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cpu import children_pinned
from bench.parts import serves_completion

START_TIMEOUT = 60.0  # seconds to first serve a completion: launch, worker health checks


class NotRun(Exception):
    """Why a peer could not be measured."""


@dataclass(frozen=True, slots=True)
class Peer:
    key: str  # as named by `--peers`
    package: str
    version: str
    launcher: str  # the module `python -m` starts ("" for a tool that is not a module)

    @property
    def label(self) -> str:
        return f"{self.package} {self.version}"

    def argv(self, python: Path, port: int, metrics_port: int, workers: Sequence[str]) -> list[str]:
        return [str(python), "-m", self.launcher, "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port), "--worker-urls", *workers]  # fmt: skip


PEERS = {
    "sglang": Peer("sglang", "sglang-router", "0.3.2", "sglang_router.launch_router"),
    "vllm": Peer("vllm", "vllm-router", "0.1.17", "vllm_router.launch_router"),
}


def free_port() -> int:
    # The kernel picks an unused port; the router binds it a moment later (a small race: a
    # router that cannot bind exits, and is reported not run).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peers_venv() -> Path:
    root = os.environ.get("BATON_BENCH_CACHE") or Path.home() / ".cache" / "baton-bench"
    return Path(root) / "peers-venv"


def _tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return " | ".join(t.strip() for t in text[-lines:]) or "no output"


def installed(peer: Peer, venv: Path, logdir: Path) -> Path:
    """The venv's python with `peer` importable, installing it the first time (a stamp file
    per package and version marks it done). Raises NotRun on any failure."""
    python = venv / "bin" / "python"
    stamp = venv / f".ok-{peer.package}-{peer.version}"
    if stamp.exists():
        return python
    log = logdir / f"overhead.install-{peer.key}.log"
    print(f"installing {peer.label} into {venv} (once; log: {log})", file=sys.stderr, flush=True)
    with log.open("wb") as out:
        steps = [[sys.executable, "-m", "venv", str(venv)]] if not python.exists() else []
        steps.append([str(python), "-m", "pip", "install", "-q", f"{peer.package}=={peer.version}"])
        if peer.launcher:
            steps.append([str(python), "-c", f"import {peer.launcher}"])
        for step in steps:
            try:
                done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise NotRun(f"install: {type(exc).__name__}: {exc}") from exc
            if done.returncode != 0:
                raise NotRun(f"install failed ({' '.join(step[1:4])}): {_tail(log)}")
    stamp.touch()
    return python


def await_serving(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until `url` serves a completion; NotRun if the process exits or time runs out."""
    deadline = time.monotonic() + START_TIMEOUT
    while not serves_completion(url):
        if proc.poll() is not None:
            raise NotRun(f"exited {proc.returncode} at start: {_tail(log)}")
        if time.monotonic() > deadline:
            raise NotRun(f"no completion served within {START_TIMEOUT:g} s: {_tail(log)}")
        time.sleep(0.2)


@dataclass(frozen=True, slots=True)
class RunningPeer:
    url: str
    pid: int


@contextlib.contextmanager
def running(
    peer: Peer, workers: Sequence[str], logdir: Path, cores: set[int] | None
) -> Iterator[RunningPeer]:
    """`peer` routing round robin over `workers`, started on `cores` (None: anywhere) and
    stopped on exit. Raises NotRun when it cannot be installed or does not serve."""
    python = installed(peer, peers_venv(), logdir)
    port, metrics_port = free_port(), free_port()
    log = logdir / f"overhead.{peer.key}.log"
    with log.open("wb") as out, children_pinned(cores):
        proc = subprocess.Popen(peer.argv(python, port, metrics_port, workers), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        await_serving(url, proc, log)
        yield RunningPeer(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
