"""What scripts/engines/setup.sh has installed, by the stamps it leaves once a step is done: a
vLLM venv or a model still being installed is not there yet (CI runs `make engines` in the
background beside `make test`, so the venv's python exists minutes before vLLM does)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE = Path(os.environ.get("BATON_ENGINE_CACHE") or Path.home() / ".cache" / "baton-engines")


def vllm_installed() -> bool:
    """vLLM's venv is whole (its `.ok-VERSION` stamp)."""
    return any((CACHE / "vllm-venv").glob(".ok-[0-9]*"))


def model_built(name: str) -> bool:
    """make_tiny_model.py's variant `name` is built (its `.ok-NAME-VERSION` stamp)."""
    return any((CACHE / "model").glob(f".ok-{name}-[0-9]*"))
