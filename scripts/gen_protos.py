"""Generate the Python stubs for proto/baton/v1 into baton/v1 (the only generator).

Run: python scripts/gen_protos.py [--out DIR]
The stubs are committed; tests/test_protos_fresh.py regenerates into a temp dir and compares.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    well_known = str(resources.files("grpc_tools") / "_proto")
    # The mypy plugins live next to this interpreter; don't depend on PATH.
    bindir = Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Generated imports are absolute (`from baton.v1 import fleet_pb2`): the output root is
    # the repo root, so packages only need their __init__ files, never import rewriting.
    for pkg in {(out / p).parent for p in protos}:
        while pkg != out:
            (pkg / "__init__.py").touch()
            pkg = pkg.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
