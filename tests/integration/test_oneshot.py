"""One-shot calls through real processes: embeddings, rerank, score, tokenize and detokenize
routed by model (the official SDK for embeddings, plain HTTP for the rest), retried before
the answer, never pinned; /v1/models with each model's context length; OpenAI-shaped errors
for bad bodies and unknown paths."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    Fleet,
    cli_json,
    fleet,
    http,
    start_control,
    start_shim,
    start_sim,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)
OTHER = "other-model"


def post(base: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    status, raw = http("POST", base + path, json.dumps(body).encode(),
                       {"Content-Type": "application/json"})  # fmt: skip
    return status, json.loads(raw)


@contextmanager
def two_models(tmp_path: Path) -> Iterator[tuple[Part, dict[str, Part], Part]]:
    """A shim over sims of two models: t0 and t1 serve MODEL, o0 serves OTHER (a longer
    context)."""
    sims = {"t0": start_sim(), "t1": start_sim(),
            "o0": start_sim("--max-model-len", "16384", model=OTHER)}  # fmt: skip
    lines = ["[probes]", "interval = 0.2", "timeout = 0.5"]
    for bid, sim in sims.items():
        model = OTHER if bid == "o0" else MODEL
        lines += ["[[backends]]", f'id = "{bid}"', f'url = "{sim.ready}"', f'model = "{model}"']
    (tmp_path / "control.toml").write_text("\n".join(lines) + "\n")
    control = start_control(tmp_path / "control.toml")
    shim = start_shim(control.ready)
    try:
        yield shim, sims, control
    finally:
        for p in (shim, control, *sims.values()):
            p.stop(grace=3)


def test_each_call_reaches_a_backend_of_its_model(tmp_path: Path) -> None:
    with two_models(tmp_path) as (shim, _, control):
        base = shim.ready
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        mine = c.embeddings.create(model=MODEL, input=["a router", "a fleet"])
        theirs = c.embeddings.create(model=OTHER, input=["a router", "a fleet"])
        assert len(mine.data) == 2 and len(mine.data[0].embedding) == 128
        assert mine.model == MODEL and theirs.model == OTHER
        assert mine.data[0].embedding != mine.data[1].embedding
        again = c.embeddings.create(model=MODEL, input=["a router", "a fleet"])
        assert again.data[0].embedding == mine.data[0].embedding  # deterministic, any replica
        status, ranked = post(base, "/v1/rerank", {"model": OTHER, "query": "router",
                                                   "documents": ["a router", "soup"]})  # fmt: skip
        assert status == 200 and ranked["model"] == OTHER and len(ranked["results"]) == 2
        status, bare = post(base, "/rerank", {"model": MODEL, "query": "router",
                                              "documents": ["soup"], "top_n": 1})  # fmt: skip
        assert status == 200 and len(bare["results"]) == 1
        status, scored = post(base, "/v1/score", {"model": MODEL, "text_1": "router",
                                                  "text_2": ["a router", "soup"]})  # fmt: skip
        assert status == 200 and len(scored["data"]) == 2
        status, tok = post(base, "/tokenize", {"model": OTHER, "prompt": "héllo wörld"})
        assert status == 200 and tok["tokens"] and tok["max_model_len"] == 16384
        status, detok = post(base, "/detokenize", {"model": OTHER, "tokens": tok["tokens"]})
        assert status == 200 and detok["prompt"].endswith("héllo wörld")  # after BOS
        routes = cli_json(control, "events", "--kind", "route")
        assert {e["backend_id"] for e in routes if e["model"] == OTHER} == {"o0"}
        # Spread, not pinned: the two MODEL replicas shared its calls.
        mine_routes = [e for e in routes if e["model"] == MODEL]
        assert {e["backend_id"] for e in mine_routes} == {"t0", "t1"}
        assert {e["reason"] for e in mine_routes} == {"spread"}
        assert wait_until(lambda: _lens(c) == {MODEL: 8192, OTHER: 16384}, 10)


def _lens(c: openai.OpenAI) -> dict[str, Any]:
    return {m.id: m.model_dump().get("max_model_len") for m in c.models.list().data}


def test_a_dead_replica_is_retried_and_demoted(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2, per_sim=[("--fault", "status=503")], probe_interval=60) as f:
        c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0)
        for _ in range(3):
            assert c.embeddings.create(model=MODEL, input="a router").data
        status, tok = post(f.shim.ready, "/tokenize", {"model": MODEL, "prompt": "x"})
        assert status == 200
        retries = json.loads(f.baton("events", "--kind", "retry", "--json").stdout)
        assert retries and {e["backend_id"] for e in retries} == {"s0"}
        assert f.backends()["s0"]["state"] == "demoted"
        pins = json.loads(f.baton("pins", "list", "--json").stdout)
        assert pins["total"] == 0  # no prefix pin for one-shot calls


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": "x"}, "model"),
        ("/v1/embeddings", {"model": MODEL}, "input"),
        ("/v1/embeddings", {"model": MODEL, "input": [1, "a"]}, "input"),
        ("/v1/rerank", {"model": MODEL, "query": "q"}, "documents"),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        ("/v1/score", {"model": MODEL, "text_1": "a"}, "text_2"),
        ("/tokenize", {"model": MODEL}, "prompt"),
        ("/detokenize", {"model": MODEL, "tokens": ["a"]}, "tokens"),
        ("/v1/responses", {"model": MODEL}, "input"),
        ("/v1/responses", {"model": MODEL, "input": "x", "store": "yes"}, "store"),
    ],
)
def test_bad_bodies_get_openai_shaped_400s(
    tmp_path: Path, path: str, body: Any, param: str, shared_fleet: Fleet
) -> None:
    status, err = post(shared_fleet.shim.ready, path, body)
    assert status == 400 and err["error"]["param"] == param
    assert err["error"]["type"] == "invalid_request_error"


def test_unknown_paths_and_models_are_named(shared_fleet: Fleet) -> None:
    status, raw = http("POST", shared_fleet.shim.ready + "/v1/audio/speech", b"{}")
    body = json.loads(raw)
    assert status == 404 and "/v1/audio/speech" in body["error"]["message"]
    status, err = post(shared_fleet.shim.ready, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and err["error"]["code"] == "model_not_found"


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(tmp_path_factory.mktemp("oneshot"), n=1) as f:
        yield f
