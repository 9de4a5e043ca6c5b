from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Fleet, fleet


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A fleet for tests that only read (bad input): started once per module."""
    path: Path = tmp_path_factory.mktemp("fleet")
    with fleet(path, n=1, shim_args=("--max-body-bytes", "4096")) as f:
        yield f
