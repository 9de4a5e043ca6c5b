"""The engine side of the sim's LoRA adapters over HTTP, in-process servers on 127.0.0.1:0:
loads per name taking turns, the LRU of loaded adapters (seen in sim:lora_loads_total), every
data-parallel rank loading, max_loras in the batch (seen in vllm:lora_requests_info and
vllm:num_requests_waiting), and the prefix cache and KV events per adapter."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import zmq

from sim.kv_wire import END_SEQ, BlockStored, KVEventBatch
from sim.state import SimState
from tests.unit.sim.lora_kit import (
    PROMPT,
    Http,
    complete,
    config,
    ids,
    load,
    loads,
    lora_info,
    make_adapter,
    prefix_hits,
    run,
    unload,
    until,
    waiting,
)

decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


def test_two_loads_of_one_name_take_turns(tmp_path: Path) -> None:
    """vLLM holds a lock per name: the second load sees the first one's adapter."""
    a = make_adapter(tmp_path, "a", 1)

    async def body(http: Http, state: SimState) -> None:
        answers = await asyncio.gather(load(http, "a", a), load(http, "a", a))
        assert sorted(status for status, _ in answers) == [200, 400]
        assert await loads(http) == {"a": 1}

    run(config("--enable-lora", "--lora-load-ms", "30"), body)


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
