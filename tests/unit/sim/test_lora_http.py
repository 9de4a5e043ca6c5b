"""The sim's LoRA adapters over HTTP, in-process servers on 127.0.0.1:0: vLLM 0.32's load and
unload routes, /v1/models, and requests under an adapter (their output, on two replicas, and
resumed). Adapter directories are built in tmp_path (tests.unit.sim.lora_kit)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from sim.server import start_server
from sim.state import SimState
from tests.unit.sim.lora_kit import (
    Http,
    complete,
    config,
    ids,
    load,
    make_adapter,
    run,
    unload,
)


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
