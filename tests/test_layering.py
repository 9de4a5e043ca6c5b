"""Policies, state machines and pure planning modules must stay pure (DESIGN §2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PURE_MODULES = [
    "control/model.py",
    "control/health.py",
    "control/load.py",
    "control/registry.py",
    "control/routing.py",
    "control/config.py",
    "control/facts.py",
    "control/pairs.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "control/policy").glob("*.py")),
    "dataplane/validate.py",
    "dataplane/shape.py",
    "dataplane/specplan.py",
    "dataplane/sse.py",
    "dataplane/failover.py",
    "dataplane/degraded.py",
    "dataplane/errors.py",
    "clients/render.py",
    *(
        f"sim/{name}.py"
        for name in (
            "tokenizer",
            "model",
            "chat_template",
            "costmodel",
            "faults",
            "protocol",
            "generation",
            "responses",
            "specdecode",
            "scoring",
        )
    ),
]

FORBIDDEN = (
    "grpc",
    "aiohttp",
    "asyncio",
    "opentelemetry",
    "time",
    "random",
    "socket",
    "requests",
    "os",
    "prometheus_client",
)
# `from random import Random` (a type for an injected rng) is allowed; the module-global
# generator and the clock are not.
ALLOWED_FROM = {("random", "Random")}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in FORBIDDEN or alias.name.endswith("_pb2") or "_pb2" in alias.name:
                    found.append(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            names = {a.name for a in node.names}
            if top in FORBIDDEN and not all((top, n) in ALLOWED_FROM for n in names):
                found.append(f"from {node.module} import {', '.join(sorted(names))}")
            if node.module.startswith("baton.v1") or any(n.endswith("_pb2") for n in names):
                found.append(f"from {node.module} import {', '.join(sorted(names))} (wire types)")
    return found


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_import_no_io_clock_or_wire_types(module: str) -> None:
    path = ROOT / module
    assert path.exists(), f"{module} is listed as pure but does not exist"
    assert _violations(path) == []


def test_the_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom grpc import aio\nfrom baton.v1 import routing_pb2\n")
    assert len(_violations(bad)) == 3
