from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.integration.harness import Fleet, fleet


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet for tests that only read (bad input): started once per module."""
    path: Path = tmp_path_factory.mktemp("fleet")
    with fleet(path, n=1, shim_args=("--max-body-bytes", "4096")) as f:
        yield f


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A ZMQ context for a test's own sockets (KV-event subscribers and publishers); destroyed
    after it, which closes whatever a failed test left open."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)
