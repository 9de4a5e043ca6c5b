"""The committed stubs must be exactly what scripts/gen_protos.py makes from proto/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    # baton/v1 is generated; the rest of baton/ is the hand-written shared core.
    fresh = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in (tmp_path / "baton" / "v1").rglob("*")
        if p.is_file()
    }
    committed = {
        p.relative_to(ROOT): p.read_bytes()
        for p in (ROOT / "baton" / "v1").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert set(fresh) == set(committed), "stub files differ: run scripts/gen_protos.py"
    stale = [str(p) for p in fresh if fresh[p] != committed[p]]
    assert stale == [], f"stale stubs (run scripts/gen_protos.py): {stale}"


def test_buf_lint_passes() -> None:
    # buf-bin is a dev dependency: its absence is a broken setup, not a reason to skip.
    buf = str(Path(sys.executable).parent / "buf")
    if not Path(buf).exists():
        buf = shutil.which("buf") or buf
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
