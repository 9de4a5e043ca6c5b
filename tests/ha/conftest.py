"""The replica suite (`make test-ha`): control replicas on a real local etcd. Every test here
is marked `ha`, so `make test` leaves them out and `pytest -m ha tests/ha` runs them all."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.etcd_server import EtcdServer
from tests.integration.harness import start_etcd

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Here, not a pytestmark per module: a test added without one would run in `make test`
    # and be left out by `-m ha`.
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.ha)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd for one test, stopped after it (whatever the test did to it)."""
    server = start_etcd(tmp_path)
    yield server
    server.stop()
