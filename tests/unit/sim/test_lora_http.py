"""The sim's LoRA adapters over HTTP, in-process servers on 127.0.0.1:0: vLLM 0.32's load and
unload routes, /v1/models, requests under an adapter (their output, on two replicas, and
resumed), the engine's LRU of loaded adapters, max_loras and vllm:lora_requests_info, and the
KV cache per adapter. Adapter directories are built in tmp_path."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from sim.config import SimConfig
from sim.kv_wire import END_SEQ, BlockStored, KVEventBatch
from sim.server import start_server
from sim.state import STATE, SimState
from tests.factories import sim_config

PROMPT = "Once upon a time the router"
decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode
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


# -- load and unload ------------------------------------------------------------------------
def test_load_and_unload_answer_as_vllm_does(tmp_path: Path) -> None:
    a = make_adapter(tmp_path, "a", 1)

    async def body(http: Http, state: SimState) -> None:
        assert await load(http, "a", a) == (200, "Success: LoRA adapter 'a' added successfully.")
        status, text = await load(http, "a", a)
        assert status == 400 and json.loads(text) == {"error": {
            "message": "The lora adapter 'a' has already been loaded. If you want to load the "
                       "adapter in place, set 'load_inplace' to True.",
            "type": "InvalidUserInput", "param": None, "code": 400}}  # fmt: skip
        assert (await load(http, "a", a, load_inplace=True))[0] == 200
        status, text = await load(http, "toy", a)
        assert status == 400 and "conflicts with a served base model" in text
        status, text = await load(http, "", a)
        assert status == 400 and "Both 'lora_name' and 'lora_path'" in text
        assert await unload(http, "a") == (200, "Success: LoRA adapter 'a' removed successfully.")
        status, text = await unload(http, "a")
        assert status == 404 and json.loads(text)["error"] == {
            "message": "The lora adapter 'a' cannot be found.", "type": "NotFoundError",
            "param": None, "code": 404}  # fmt: skip

    run(config("--enable-lora"), body)


def test_a_load_that_fails_answers_as_vllm_does(tmp_path: Path) -> None:
    make_adapter(tmp_path, "big", 1, r=64)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 8, "target_modules": []}))

    async def body(http: Http, state: SimState) -> None:
        status, text = await load(http, "x", tmp_path / "nowhere")
        assert status == 404 and json.loads(text)["error"] == {
            "message": "Loading lora x failed: No adapter found for <path>",
            "type": "NotFoundError", "param": None, "code": 404}  # fmt: skip
        status, text = await load(http, "x", tmp_path / "big")
        assert status == 500 and json.loads(text)["error"]["message"] == (
            "Call to add_lora method failed: LoRA rank 64 is greater than max_lora_rank 16.")
        status, text = await load(http, "x", tmp_path / "empty")
        assert status == 500 and "<path> doesn't contain tensors" in text
        async with http.post("/v1/load_lora_adapter", json={"lora_path": "/x"}) as r:
            err = (await r.json())["error"]
        assert (r.status, err["type"], err["param"]) == (400, "Bad Request", "body.lora_name")
        assert err["message"].startswith("1 validation error:\n  {'type': 'missing'")
        async with http.post("/v1/load_lora_adapter", data=b"{}") as r:
            assert r.status == 400 and "Only 'application/json'" in await r.text()
        async with http.get("/v1/models") as r:
            assert [c["id"] for c in (await r.json())["data"]] == ["toy"]  # nothing registered

    run(config("--enable-lora"), body)


def test_the_routes_need_the_variable_and_loads_need_enable_lora(tmp_path: Path) -> None:
    a = make_adapter(tmp_path, "a", 1)

    async def without_routes(http: Http, state: SimState) -> None:
        assert (await load(http, "a", a))[0] == 404

    async def without_lora(http: Http, state: SimState) -> None:
        status, text = await load(http, "a", a)
        assert status == 500 and json.loads(text)["error"]["message"] == (
            "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable "
            "LoRA.")  # fmt: skip

    run(config("--enable-lora", runtime=False), without_routes)
    run(config(), without_lora)


def test_models_lists_each_adapter_with_its_path_and_parent(tmp_path: Path) -> None:
    a, b = make_adapter(tmp_path, "a", 1), make_adapter(tmp_path, "b", 2)

    async def body(http: Http, state: SimState) -> None:
        await load(http, "b", b)
        async with http.get("/v1/models") as r:
            cards = (await r.json())["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
            ("toy", "toy", None), ("a", str(a), "toy"), ("b", str(b), "toy")]
        assert cards[1]["object"] == "model" and cards[1]["max_model_len"] is None
        await unload(http, "a")
        async with http.get("/v1/models") as r:
            assert [c["id"] for c in (await r.json())["data"]] == ["toy", "b"]

    run(config("--enable-lora", "--lora-modules", f"a={a}"), body)


def test_a_static_adapter_that_cannot_load_stops_the_start(tmp_path: Path) -> None:
    async def go() -> None:
        await start_server(config("--enable-lora", "--lora-modules", f"a={tmp_path}/none"))

    with pytest.raises(SystemExit, match="--lora-modules a: Loading lora a failed"):
        asyncio.run(go())


# -- requests under an adapter ----------------------------------------------------------------
def test_each_adapter_has_its_own_output_and_names_the_response(tmp_path: Path) -> None:
    a, b = make_adapter(tmp_path, "a", 1), make_adapter(tmp_path, "b", 2)

    async def body(http: Http, state: SimState) -> None:
        base, out_a, out_b = [await complete(http, m) for m in ("toy", "a", "b")]
        assert len({tuple(ids(o)) for o in (base, out_a, out_b)}) == 3
        assert (base["model"], out_a["model"], out_b["model"]) == ("toy", "a", "b")
        assert ids(await complete(http, "a")) == ids(out_a)  # deterministic
        async with http.post("/v1/chat/completions", json={
                "model": "a", "messages": [{"role": "user", "content": "hi"}]}) as r:
            chat = await r.json()
        assert r.status == 200 and chat["model"] == "a"
        async with http.post("/v1/completions", json={"model": "c", "prompt": "x"}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["message"] == (
                "The model `c` does not exist. Valid aliases: toy.")
        async with http.post("/tokenize", json={"model": "a", "prompt": "hi"}) as r:
            assert r.status == 200

    run(config("--enable-lora", "--max-loras", "2", "--lora-modules", f"a={a}", f"b={b}"), body)


def test_messages_and_responses_run_under_the_adapter_too(tmp_path: Path) -> None:
    a = make_adapter(tmp_path, "a", 1)
    messages = [{"role": "user", "content": "Tell me a story"}]

    async def body(http: Http, state: SimState) -> None:
        texts = {}
        for model in ("toy", "a"):
            async with http.post("/v1/chat/completions", json={
                    "model": model, "messages": messages, "max_tokens": 12}) as r:
                texts[model] = (await r.json())["choices"][0]["message"]["content"]
        assert texts["a"] != texts["toy"]
        async with http.post("/v1/messages", json={
                "model": "a", "messages": messages, "max_tokens": 12}) as r:
            msg = await r.json()
        assert r.status == 200 and msg["model"] == "a"
        assert msg["content"][0]["text"] == texts["a"]  # the same chat request underneath
        async with http.post("/v1/responses", json={
                "model": "a", "input": "Tell me a story", "max_output_tokens": 12}) as r:
            resp = await r.json()
        assert r.status == 200 and resp["model"] == "a"

    run(config("--enable-lora", "--lora-modules", f"a={a}"), body)


def test_two_loads_of_one_name_take_turns(tmp_path: Path) -> None:
    """vLLM holds a lock per name: the second load sees the first one's adapter."""
    a = make_adapter(tmp_path, "a", 1)

    async def body(http: Http, state: SimState) -> None:
        answers = await asyncio.gather(load(http, "a", a), load(http, "a", a))
        assert sorted(status for status, _ in answers) == [200, 400]
        assert await loads(http) == {"a": 1}

    run(config("--enable-lora", "--lora-load-ms", "30"), body)


def test_two_replicas_loading_the_same_weights_agree(tmp_path: Path) -> None:
    """The output is the weights', not the name's: a copy under another name agrees."""
    a = make_adapter(tmp_path, "a", 1)
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "a-copy")
    other = make_adapter(tmp_path, "other", 3)
    outs: list[list[int]] = []

    async def body(http: Http, state: SimState) -> None:
        for name in ("a", "same", "other"):
            outs.append(ids(await complete(http, name, max_tokens=24)))

    modules = (f"a={a}", f"same={copy}", f"other={other}")
    run(config("--enable-lora", "--max-cpu-loras", "3", "--lora-modules", *modules), body)
    run(config("--enable-lora", "--max-cpu-loras", "3", "--chip-seed", "5", "--lora-modules",
               *modules), body)  # fmt: skip
    assert outs[0] == outs[1] == outs[3] == outs[4]
    assert outs[2] == outs[5] != outs[0]


def test_a_resumed_request_continues_exactly_under_its_adapter(tmp_path: Path) -> None:
    a = make_adapter(tmp_path, "a", 1)

    async def body(http: Http, state: SimState) -> None:
        first = await complete(http, "a", max_tokens=20)
        prompt = first["choices"][0]["prompt_token_ids"]
        assert prompt is not None
        for k in (1, 9):
            resumed = await complete(http, "a", prompt + ids(first)[:k], max_tokens=20 - k)
            assert ids(resumed) == ids(first)[k:]

    run(config("--enable-lora", "--lora-modules", f"a={a}"), body)


# -- the engine's loaded adapters ----------------------------------------------------------
def test_an_evicted_adapter_is_loaded_again_by_its_next_request(tmp_path: Path) -> None:
    a, b, c = (make_adapter(tmp_path, n, i) for i, n in enumerate("abc"))

    async def body(http: Http, state: SimState) -> None:
        for name, path in (("a", a), ("b", b), ("c", c)):
            await load(http, name, path)
        assert await loads(http) == {"a": 1, "b": 1, "c": 1}  # c's load evicted a
        await complete(http, "b")
        await complete(http, "c")
        assert await loads(http) == {"a": 1, "b": 1, "c": 1}  # both loaded: no cost
        await complete(http, "a")  # evicted: loaded again, evicting b (least recent)
        assert await loads(http) == {"a": 2, "b": 1, "c": 1}
        await complete(http, "c")
        await complete(http, "b")
        assert await loads(http) == {"a": 2, "b": 2, "c": 1}
        await unload(http, "c")  # the registry only: the engine keeps its weights
        assert (await load(http, "c", c))[0] == 200  # a new id to the engine: loaded again
        assert await loads(http) == {"a": 2, "b": 2, "c": 2}

    run(config("--enable-lora", "--max-cpu-loras", "2"), body)


def test_every_rank_loads_an_adapter_and_serves_it_alike(tmp_path: Path) -> None:
    a = make_adapter(tmp_path, "a", 1)

    async def body(http: Http, state: SimState) -> None:
        await load(http, "a", a)
        assert await loads(http, 0) == await loads(http, 1) == {"a": 1}  # vLLM's add_lora: all
        outs = [ids(await complete(http, "a", headers={"X-data-parallel-rank": str(r)}))
                for r in (0, 1)]  # fmt: skip
        assert outs[0] == outs[1]
        assert await loads(http, 1) == {"a": 1}  # loaded there already: no cost

    run(config("--enable-lora", "--data-parallel-size", "2"), body)


# -- max_loras and vllm:lora_requests_info ----------------------------------------------------
def test_a_request_for_one_adapter_too_many_waits_for_the_batch(tmp_path: Path) -> None:
    a, b = make_adapter(tmp_path, "a", 1), make_adapter(tmp_path, "b", 2)
    stall = {"X-Sim-Fault": "stall-after=2"}  # holds its place in the batch until cancelled

    async def body(http: Http, state: SimState) -> None:
        stream = {"model": "a", "prompt": PROMPT, "max_tokens": 8, "stream": True}
        async with http.post("/v1/completions", json=stream, headers=stall) as held:
            await held.content.readline()  # a's request is running
            await until(lambda: _labels_are(http, "a"))
            blocked = asyncio.create_task(
                _post(http, {"model": "b", "prompt": PROMPT, "max_tokens": 4}, stall))
            await until(lambda: _waiting_is(http, 1))
            info = await lora_info(http)
            assert info == {"max_lora": "1", "waiting_lora_adapters": "a",
                            "running_lora_adapters": "a"}  # b's is not seen while it waits
            assert ids(await complete(http, "toy", max_tokens=4))  # the base never waits
            assert ids(await complete(http, "a", max_tokens=4))  # nor does a's own adapter
            assert await waiting(http) == 1
        await until(lambda: _labels_are(http, "b"))  # a's request ended: b's runs
        assert await waiting(http) == 0
        blocked.cancel()
        await until(lambda: _labels_are(http, ""))

    run(config("--enable-lora", "--max-cpu-loras", "2", "--lora-modules", f"a={a}", f"b={b}"),
        body)  # fmt: skip


async def _post(http: Http, body: dict[str, Any], headers: dict[str, str]) -> None:
    async with http.post("/v1/completions", json=body, headers=headers) as r:
        await r.read()


async def _labels_are(http: Http, names: str) -> bool:
    info = await lora_info(http)
    return info["running_lora_adapters"] == info["waiting_lora_adapters"] == names


async def _waiting_is(http: Http, n: int) -> bool:
    return await waiting(http) == n


# -- KV blocks and events ---------------------------------------------------------------------
def replayed(endpoint: str) -> list[BlockStored]:
    """Every BlockStored the publisher has sent, asked of its replay socket (from seq 0)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[BlockStored] = []
        while True:
            _, _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
    finally:
        sock.close()
        ctx.term()


def test_prefix_cache_and_kv_events_are_per_adapter(tmp_path: Path) -> None:
    a, b = make_adapter(tmp_path, "a", 1), make_adapter(tmp_path, "b", 2)
    prompt = list(range(300, 340))  # 2 full blocks of 16, and 8 more

    async def body(http: Http, state: SimState) -> None:
        async def cached(model: str) -> int:
            before = await prefix_hits(http)
            await complete(http, model, prompt, max_tokens=1)
            return int(await prefix_hits(http) - before)

        hits = [await cached(m) for m in ("a", "a", "b", "toy", "b")]
        assert hits == [0, 32, 0, 0, 32]
        pub = state.engines[0].kv_events
        assert pub is not None and pub.replay_endpoint is not None
        endpoint = pub.replay_endpoint
        stored: list[BlockStored] = []

        async def all_three() -> bool:
            stored[:] = await asyncio.to_thread(replayed, endpoint)
            return len(stored) == 3

        await until(all_three)
        by_name = {e.lora_name: e for e in stored}
        assert set(by_name) == {"a", "b", None}
        assert (by_name["a"].lora_id, by_name["b"].lora_id, by_name[None].lora_id) == (1, 2, None)
        assert by_name["a"].extra_keys == [("a",), ("a",)]
        assert by_name[None].extra_keys == [None, None]
        assert by_name["a"].token_ids == by_name["b"].token_ids == prompt[:32]
        assert not set(by_name["a"].block_hashes) & set(by_name["b"].block_hashes)

    run(config("--enable-lora", "--max-loras", "2", "--cache-blocks", "64",
               "--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0",
               "--lora-modules", f"a={a}", f"b={b}"), body)  # fmt: skip
