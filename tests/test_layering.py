"""The architecture, checked over every file (docs/architecture.md):

- packages import only what their layer allows: the shared core (`baton/`: domain types, the
  wire border, spreading, tracing, the event loop, and the generated contract in `baton/v1`)
  is beside everything; control, the shim (dataplane) and the admin CLI (clients) each import
  only the core and themselves; the simulated engine imports nothing of Baton's;
- modules marked `# baton: pure` (policies, state machines, planners) do no I/O and read no
  clock, no global randomness and no wire types (DESIGN §2); a module that already is pure
  must say so, so the next change cannot quietly make it impure.

Failures name the file, the line and the import."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Who may import whom (first-party packages only; third-party libraries are not limited here).
ALLOWED: dict[str, frozenset[str]] = {
    "baton": frozenset({"baton"}),
    "control": frozenset({"baton", "control"}),
    "dataplane": frozenset({"baton", "dataplane"}),
    "clients": frozenset({"baton", "clients"}),
    "sim": frozenset({"sim"}),
}
FIRST_PARTY = frozenset({*ALLOWED, "bench", "scripts", "tests"})
GENERATED = ROOT / "baton" / "v1"

PURE_MARK = "# baton: pure"
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
    "subprocess",
    "threading",
    "sqlite3",
    "tomllib",
)
# `from random import Random` (a type for an injected rng) is allowed; the module-global
# generator and the clock are not.
ALLOWED_FROM = {("random", "Random")}


def package_files() -> Iterator[Path]:
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GENERATED not in path.parents:
                yield path


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def imported(tree: ast.AST) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names) of every import, at any depth (a function's too). Relative
    imports stay inside their package, so they are left out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, tuple(a.name for a in node.names)


def layer_breaks(path: Path, package: str) -> list[str]:
    allowed = ALLOWED[package]
    found = []
    for line, module, names in imported(ast.parse(path.read_text(), filename=str(path))):
        top = module.split(".")[0]
        if top in FIRST_PARTY and top not in allowed:
            what = f"from {module} import {', '.join(names)}" if names else f"import {module}"
            found.append(f"{rel(path)}:{line}: {what} ({package} may import only "
                         f"{', '.join(sorted(allowed))})")  # fmt: skip
    return found


def impurities(path: Path) -> list[str]:
    found = []
    for line, module, names in imported(ast.parse(path.read_text(), filename=str(path))):
        top = module.split(".")[0]
        what = f"from {module} import {', '.join(names)}" if names else f"import {module}"
        if top in FORBIDDEN and not (names and all((top, n) in ALLOWED_FROM for n in names)):
            found.append(f"{rel(path)}:{line}: {what}")
        elif module.startswith("baton.v1") or "_pb2" in module or any("_pb2" in n for n in names):
            found.append(f"{rel(path)}:{line}: {what} (wire types)")
    return found


def is_marked(path: Path) -> bool:
    return any(line.strip() == PURE_MARK for line in path.read_text().splitlines())


@pytest.mark.parametrize("package", list(ALLOWED))
def test_each_package_imports_only_what_its_layer_allows(package: str) -> None:
    files = [p for p in package_files() if p.relative_to(ROOT).parts[0] == package]
    assert files, f"no files found for {package}"
    assert [b for p in files for b in layer_breaks(p, package)] == []


def test_marked_modules_are_pure() -> None:
    marked = [p for p in package_files() if is_marked(p)]
    # The policies, the registry's state machines and the resume planner at least.
    assert len(marked) >= 20, [rel(p) for p in marked]
    assert [i for p in marked for i in impurities(p)] == []


def test_a_module_that_is_pure_says_so() -> None:
    unmarked = [
        rel(p)
        for p in package_files()
        if not is_marked(p) and not impurities(p) and p.name != "__init__.py"
        and p.read_text().strip()
    ]  # fmt: skip
    assert unmarked == [], f"pure already: mark them {PURE_MARK!r} (or make them plumbing)"


def test_the_checkers_catch_what_they_are_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import time\nfrom grpc import aio\nfrom baton.v1 import routing_pb2\n"
        "def f():\n    from control.registry import Registry\n"
    )
    assert len(impurities(bad)) == 3
    breaks = layer_breaks(bad, "dataplane")
    assert len(breaks) == 1 and "control.registry" in breaks[0] and ":5:" in breaks[0]
    assert layer_breaks(bad, "control") == []
    good = tmp_path / "good.py"
    good.write_text("from random import Random\nfrom baton.model import Backend\n")
    assert impurities(good) == [] and layer_breaks(good, "sim") != []
