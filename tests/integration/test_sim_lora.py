"""The sim as `python -m sim --enable-lora` processes, as vLLM's `vllm serve --enable-lora`: the
runtime routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING in the environment, static
--lora-modules loaded before READY, and two replicas agreeing on an adapter's output whether
it was given at start or loaded at runtime, under any name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from clients.procs import Part, StartFailed
from tests.integration.harness import MODEL, http

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def make_adapter(root: Path, name: str, seed: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    (d / "adapter_model.safetensors").write_bytes(bytes([seed]) * 128)
    return d


@contextmanager
def sim(*extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    part = Part("sim", ["sim", "--listen", "127.0.0.1:0", "--model", MODEL, "--instant",
                        "--enable-lora", *extra], env=env)  # fmt: skip
    try:
        yield part.ready
    finally:
        part.stop()


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    return http("POST", url + path, json.dumps(body).encode(),
                {"Content-Type": "application/json"})  # fmt: skip


def greedy(url: str, model: str) -> list[int]:
    status, data = post(url, "/v1/completions", {
        "model": model, "prompt": "The router sent the request to", "max_tokens": 24,
        "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert status == 200, data
    out: list[int] = json.loads(data)["choices"][0]["token_ids"]
    return out


def test_replicas_agree_on_an_adapter_given_at_start_or_loaded_later(tmp_path: Path) -> None:
    a = make_adapter(tmp_path, "a", 1)
    with sim("--lora-modules", f"a={a}") as one, sim(env=RUNTIME) as two:
        assert post(one, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(a)})[0] \
            == 404  # no variable: no route
        status, text = post(two, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(a)})
        assert (status, text) == (200, b"Success: LoRA adapter 'a2' added successfully.")
        out = greedy(one, "a")
        assert out == greedy(two, "a2") != greedy(one, MODEL)
        status, data = http("GET", two + "/v1/models")
        cards = json.loads(data)["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
            (MODEL, None, MODEL), ("a2", MODEL, str(a))]


def test_a_static_adapter_that_cannot_load_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(StartFailed), sim("--lora-modules", f"a={tmp_path / 'missing'}"):
        pass
