"""Real engines for the `real` suite: one pool of replicas per session (2 vLLM, 3
llama-server; a vLLM cold start costs 30-50 s, so they are started once and a killed one is
restarted in the background while other tests run). Each test puts Baton (control + shim,
real processes on free ports) in front of the replicas it names."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from scripts.engines.replicas import MODEL, Cache, Engine, Replicas
from tests.integration.harness import Fleet, start_control, start_shim

VLLM = ("v0", "v1")
LLAMA = ("l0", "l1", "l2")


class Pool:
    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    def get(self, *names: str) -> list[Engine]:
        """The named replicas, alive and healthy (a dead one is restarted first)."""
        for n in names:
            if not self.replicas.engines[n].alive:
                self.replicas.restart(n)
        self.replicas.wait_healthy(list(names))
        return [self.replicas.engines[n] for n in names]

    def revive(self, name: str) -> None:
        """Start a killed replica again without waiting: the next get() waits for it."""
        self.replicas.restart(name)


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    cache = Cache.default()
    if cache.missing():
        pytest.fail(f"engines not set up: run `make engines` ({cache.missing()})")
    with Replicas(cache, tmp_path_factory.mktemp("engines")) as replicas:
        for core, name in enumerate(VLLM):
            replicas.start_vllm(name, core=core % (os.cpu_count() or 1))
        for name in LLAMA:
            replicas.start_llama(name)
        replicas.wait_healthy()
        yield Pool(replicas)


def write_config(path: Path, engines: Sequence[Engine], routing: str, probe: float) -> Path:
    lines = [f'routing = "{routing}"', "[probes]", f"interval = {probe}", "timeout = 1.0", ""]
    for e in engines:
        lines += ["[[backends]]", f'id = "{e.name}"', f'url = "{e.url}"']
        lines += [f'model = "{MODEL}"', f'kind = "{e.baton_kind}"', ""]
    path.write_text("\n".join(lines))
    return path


@contextmanager
def baton(
    tmp_path: Path,
    engines: Sequence[Engine],
    *,
    routing: str = "roundrobin",
    probe: float = 0.5,
    shim_args: Sequence[str] = (),
) -> Iterator[Fleet]:
    """Control and one shim in front of `engines` (backend id = replica name)."""
    control = start_control(write_config(tmp_path / "control.toml", engines, routing, probe))
    try:
        shim = start_shim(control.ready, *shim_args)
    except BaseException:
        control.stop()
        raise
    try:
        yield Fleet({}, control, shim, [control, shim])
    finally:
        shim.stop(grace=3)
        control.stop(grace=3)


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def events(fleet: Fleet, kind: str, request_id: str = "") -> list[dict[str, Any]]:
    args = ["events", "--kind", kind, "--json", "--timeout", "30"]
    if request_id:
        args += ["--request-id", request_id]
    out = fleet.baton(*args)
    assert out.returncode == 0, out.stderr
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows
