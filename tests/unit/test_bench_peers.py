"""A Rust router that cannot be installed or started is reported, never a crash of the bench."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import peers
from bench.peers import NotRun, Peer

FAKE = Peer("fake", "fake-router", "0.0.1", "no_such_launcher_module")


def test_every_peer_routes_round_robin_over_all_the_workers() -> None:
    for peer in peers.PEERS.values():
        argv = peer.argv(Path("/venv/bin/python"), 8001, 8002, ["http://a:1", "http://b:2"])
        assert argv[:3] == ["/venv/bin/python", "-m", peer.launcher]
        assert argv[argv.index("--policy") + 1] == "round_robin"
        assert argv[argv.index("--port") + 1] == "8001"
        assert argv[argv.index("--prometheus-port") + 1] == "8002"  # never the fixed 29000
        assert argv[argv.index("--worker-urls") + 1 :] == ["http://a:1", "http://b:2"]


def fake_venv(root: Path, python: str) -> Path:
    """A peers venv at `root` whose python is a link to `python`."""
    venv = root / "peers-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(python)
    return venv


def test_a_failed_install_is_not_run_with_pips_last_words(tmp_path: Path) -> None:
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'ERROR: no matching distribution'\nexit 1\n")
    failing.chmod(0o755)
    venv = fake_venv(tmp_path, str(failing))
    with pytest.raises(NotRun, match="install failed .*no matching distribution"):
        peers.installed(FAKE, venv, tmp_path)
    assert not list(venv.glob(".ok-*"))  # tried again next time


def test_a_peer_that_exits_at_start_is_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = fake_venv(tmp_path, sys.executable)
    (venv / f".ok-{FAKE.package}-{FAKE.version}").touch()  # installed, as far as it knows
    monkeypatch.setenv("BATON_BENCH_CACHE", str(tmp_path))
    with pytest.raises(NotRun, match="exited 1 at start: .*no_such_launcher_module"):
        with peers.running(FAKE, ["http://127.0.0.1:9"], tmp_path, None):
            pass
