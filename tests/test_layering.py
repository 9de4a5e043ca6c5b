"""The architecture, checked over every file (docs/architecture.md):

- packages import only what their layer allows: the shared core (`baton/`: domain types, the
  wire border, spreading, tracing, the event loop, and the generated contract in `baton/v1`)
  is beside everything; control, the shim (dataplane) and the admin CLI (clients) each import
  only the core and themselves; the simulated engine imports nothing of Baton's;
- inside control and the shim, each room (a subpackage or a top-level module: one concept)
  imports only the rooms below it in ROOMS, so each package reads bottom up and no two rooms
  lean on each other;
- no package has an import cycle between its modules, counting imports inside functions and
  under TYPE_CHECKING (a cycle hidden there still ties the modules together);
- modules marked `# baton: pure` (policies, state machines, planners) do no I/O and read no
  clock, no global randomness and no wire types (docs/architecture.md#pure-modules); a module that
  already is pure must say so, so the next change cannot quietly make it impure.

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

# The rooms of control and the shim, bottom up: a room imports only rooms of earlier rows
# (and itself). A new room must be placed here, which is where it is decided what it may use.
ROOMS: dict[str, tuple[tuple[str, ...], ...]] = {
    "control": (
        ("exceptions",),
        ("settings",),  # one dataclass per config table
        ("backend_spec",),  # a backend as an operator writes it
        ("audit", "signals"),  # the audit log; what engines publish (load, KV events, facts)
        ("fleet",),  # the registry (the one owner of fleet state), its tables and its feeds
        ("pairs",),  # speculative pairs and their gate
        ("routing",),  # the router and the policies
        ("discovery",),  # engines found in the cluster (Kubernetes, DNS), joined to the registry
        ("config",),  # the TOML file, checked against the policies
        ("metrics",),
        ("replicas",),  # control replicas on etcd: election, store, the leader's soft state
        ("api",),  # the gRPC services: translation only
        ("server",),  # wiring
        ("__main__",),
    ),
    "dataplane": (
        ("sse",),
        ("exceptions",),  # every exception, the client's OpenAIError among them
        ("request", "settings", "metrics", "prefix_chain", "refusals"),
        ("outcomes",),  # how a request ended, as control hears it
        ("upstream", "link"),  # talking to engines; talking to control
        ("relay",),  # a client's stream relayed, and resumed on failure (relay/resume)
        # The Responses and Messages APIs; router-level speculative decoding
        ("responses", "messages", "spec"),
        ("apis",),  # each API in one place: its protocol, the endpoint table, the passthrough
        ("edge",),  # the HTTP edge: the front door, the handlers, the proxy
        ("__main__",),
    ),
}

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


def room_of(path: Path, package: str, root: Path = ROOT) -> str:
    parts = path.relative_to(root / package).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def room_breaks(path: Path, package: str, root: Path = ROOT) -> list[str]:
    rows = ROOMS[package]
    row = {room: i for i, names in enumerate(rows) for room in names}
    here = room_of(path, package, root)
    found = []
    for line, module, _ in imported(ast.parse(path.read_text(), filename=str(path))):
        parts = module.split(".")
        if parts[0] != package or len(parts) < 2 or parts[1] == here:
            continue
        there = parts[1]
        if there not in row or row[there] >= row[here]:
            found.append(f"{rel(path)}:{line}: {here} imports {module} ({there} is not below it)")
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, wherever the import sits (ast.walk reaches
    function bodies and TYPE_CHECKING blocks); relative imports resolved."""
    paths = {module_name(p): p for p in package_files() if p.relative_to(ROOT).parts[0] == package}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for name, path in paths.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                anchor = base[: len(base) - node.level + 1] if node.level else []
                mod = ".".join([*anchor, node.module] if node.module else anchor)
                targets = [mod, *(f"{mod}.{a.name}" for a in node.names)]
            graph[name] |= {t for t in targets if t in paths and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
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


@pytest.mark.parametrize("package", list(ROOMS))
def test_each_room_imports_only_rooms_below_it(package: str) -> None:
    files = [p for p in package_files() if p.relative_to(ROOT).parts[0] == package]
    placed = {room for row in ROOMS[package] for room in row}
    assert {room_of(p, package) for p in files if p.name != "__init__.py"} == placed - {""}, (
        "every room is placed in ROOMS, and every room there exists"
    )
    assert [b for p in files for b in room_breaks(p, package)] == []


@pytest.mark.parametrize("package", list(ALLOWED))
def test_no_package_has_an_import_cycle(package: str) -> None:
    assert cycles(import_graph(package)) == []


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
        "def f():\n    from control.fleet.registry import Registry\n"
    )
    assert len(impurities(bad)) == 3
    breaks = layer_breaks(bad, "dataplane")
    assert len(breaks) == 1 and "control.fleet.registry" in breaks[0] and ":5:" in breaks[0]
    assert layer_breaks(bad, "control") == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    upstream = tmp_path / "dataplane" / "upstream"
    upstream.mkdir(parents=True)
    (upstream / "engine.py").write_text(
        "from dataplane.sse import Event\n"
        "def f():\n    from dataplane.relay.stream import StreamRelay\n"
    )
    (breaks,) = room_breaks(upstream / "engine.py", "dataplane", tmp_path)
    assert ":3: upstream imports dataplane.relay.stream" in breaks
    good = tmp_path / "good.py"
    good.write_text("from random import Random\nfrom baton.model import Backend\n")
    assert impurities(good) == [] and layer_breaks(good, "sim") != []
