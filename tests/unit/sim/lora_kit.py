"""What the sim's LoRA tests over HTTP share: adapter directories in tmp_path, in-process
servers on 127.0.0.1:0, the routes and /metrics as a client reads them, and a bounded wait on
the server's state."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sim.config import SimConfig
from sim.server import start_server
from sim.state import STATE, SimState
from tests.factories import sim_config

PROMPT = "Once upon a time the router"
Http = aiohttp.ClientSession


def make_adapter(root: Path, name: str, seed: int, *, r: int = 8) -> Path:
    """A directory vLLM would load: adapter_config.json and a (dummy) weights file."""
    d = root / name
    d.mkdir(parents=True)
    config = {"r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
              "peft_type": "LORA", "base_model_name_or_path": "toy"}  # fmt: skip
    (d / "adapter_config.json").write_text(json.dumps(config))
    (d / "adapter_model.safetensors").write_bytes(bytes([seed]) * 64)
    return d


def config(*argv: str, runtime: bool = True) -> SimConfig:
    cfg = sim_config("--instant", "--model", "toy", *argv)
    return replace(cfg, runtime_lora_updating=runtime)


@asynccontextmanager
async def serving(cfg: SimConfig) -> AsyncIterator[tuple[Http, SimState]]:
    runner, port = await start_server(cfg, port=0)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield http, runner.app[STATE]
    finally:
        await runner.cleanup()


def run(cfg: SimConfig, body: Callable[[Http, SimState], Awaitable[None]]) -> None:
    async def go() -> None:
        async with serving(cfg) as (http, state):
            await body(http, state)

    asyncio.run(go())


async def load(http: Http, name: str, path: str | Path, **extra: Any) -> tuple[int, str]:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    async with http.post("/v1/load_lora_adapter", json=body) as r:
        return r.status, await r.text()


async def unload(http: Http, name: str) -> tuple[int, str]:
    async with http.post("/v1/unload_lora_adapter", json={"lora_name": name}) as r:
        return r.status, await r.text()


async def complete(http: Http, model: str, prompt: str | list[int] = PROMPT,
                   max_tokens: int = 16, headers: dict[str, str] | None = None,
                   ) -> dict[str, Any]:  # fmt: skip
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    async with http.post("/v1/completions", json=body, headers=headers) as r:
        out: dict[str, Any] = await r.json()
        assert r.status == 200, out
        return out


def ids(out: dict[str, Any]) -> list[int]:
    token_ids: list[int] = out["choices"][0]["token_ids"]
    return token_ids


async def metrics(http: Http) -> dict[str, Any]:
    async with http.get("/metrics") as r:
        return {f.name: f for f in text_string_to_metric_families(await r.text())}


async def loads(http: Http, rank: int = 0) -> dict[str, float]:
    """sim:lora_loads_total by adapter, on one rank."""
    fam = (await metrics(http))["sim:lora_loads"]
    return {s.labels["adapter"]: s.value for s in fam.samples
            if s.name.endswith("_total") and s.labels["engine"] == str(rank)}  # fmt: skip


async def prefix_hits(http: Http) -> float:
    fam = (await metrics(http))["vllm:prefix_cache_hits"]
    return float(sum(s.value for s in fam.samples if s.name.endswith("_total")))


async def lora_info(http: Http) -> dict[str, str]:
    """The current vllm:lora_requests_info label set: the sample with the latest time."""
    samples = (await metrics(http))["vllm:lora_requests_info"].samples
    labels: dict[str, str] = max(samples, key=lambda s: s.value).labels
    return labels


async def waiting(http: Http) -> float:
    fam = (await metrics(http))["vllm:num_requests_waiting"]
    return float(sum(s.value for s in fam.samples))


async def until(check: Callable[[], Awaitable[bool]], tries: int = 1000) -> None:
    """Wait on the server's state (polled every 10 ms, for 10 s at most)."""
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never reached the state waited for")
