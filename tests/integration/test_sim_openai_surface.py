"""The sim's Responses API, store, pooling endpoints and models card, as real processes.

What a client (or a router proxying them) notices: vLLM 0.32's event order and
fields, sequence numbers, usage, the store and its 404s, Responses text equal to
chat's for the same messages, whole characters in every delta, faults cutting a
Responses stream, deterministic embeddings across replicas, and 400s for bad input.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from clients.procs import Part
from tests.integration.harness import MODEL, http, start_sim

QUESTION = "What does a router do?"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
EVENT_ORDER = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta",
]  # fmt: skip
CLOSING = [
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.completed",
]  # fmt: skip


@dataclass
class SSE:
    status: int
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    other: list[bytes] = field(default_factory=list)  # frames that are not event+data
    broken: BaseException | None = None

    @property
    def types(self) -> list[str]:
        return [t for t, _ in self.events]

    def text(self) -> str:
        return "".join(d["delta"] for t, d in self.events if t == "response.output_text.delta")

    def last(self) -> dict[str, Any]:
        return self.events[-1][1]


def sse(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> SSE:
    async def go() -> SSE:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            async with s.post(url, json={"model": MODEL, **body, "stream": True},
                              headers=headers) as r:  # fmt: skip
                out, buf = SSE(r.status), b""
                try:
                    async for piece in r.content.iter_any():
                        buf += piece
                        while b"\n\n" in buf:
                            frame, buf = buf.split(b"\n\n", 1)
                            lines = frame.split(b"\n")
                            if len(lines) == 2 and lines[0].startswith(b"event: "):
                                data = json.loads(lines[1].removeprefix(b"data: "))
                                out.events.append((lines[0][7:].decode(), data))
                            else:
                                out.other.append(frame)
                except aiohttp.ClientError as e:
                    out.broken = e
                return out

    return asyncio.run(go())


def call(part: Part, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, raw = http(method, part.ready + path, data, {"Content-Type": "application/json"})
    return status, json.loads(raw) if raw else None


def respond(part: Part, **body: Any) -> dict[str, Any]:
    status, out = call(part, "POST", "/v1/responses", {"model": MODEL, **body})
    assert status == 200, out
    return out


def chat(part: Part, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    status, out = call(part, "POST", "/v1/chat/completions", body)
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def sim() -> Iterator[Part]:
    p = start_sim("--responses-delete")
    yield p
    p.stop(grace=3)


@pytest.fixture(scope="module")
def byte_sim() -> Iterator[Part]:
    p = start_sim("--byte-level", "--responses-store", "0")
    yield p
    p.stop(grace=3)


# -- the Responses stream and object ----------------------------------------------
def test_stream_events_in_vllm_order_with_rising_sequence_numbers(sim: Part) -> None:
    s = sse(sim.ready + "/v1/responses", {"input": QUESTION, "max_output_tokens": 12})
    assert s.status == 200 and s.broken is None
    assert s.other == []  # no `data: [DONE]`: vLLM ends a Responses stream with response.completed
    n_deltas = s.types.count("response.output_text.delta")
    assert s.types == EVENT_ORDER + ["response.output_text.delta"] * (n_deltas - 1) + CLOSING
    assert [d["sequence_number"] for _, d in s.events] == list(range(len(s.events)))
    assert all(d["type"] == t for t, d in s.events)
    created = s.events[0][1]["response"]
    assert created["id"].startswith("resp_") and created["status"] == "in_progress"
    assert created["output"] == [] and created["usage"] is None
    item_id = s.events[2][1]["item"]["id"]
    assert item_id.startswith("msg_") and s.events[2][1]["item"]["status"] == "in_progress"
    assert {d.get("item_id", item_id) for _, d in s.events[3:-1]} == {item_id}
    final = s.last()["response"]
    assert final["id"] == created["id"] and final["object"] == "response"
    # 12 tokens ran out: "incomplete", told why, in a response.completed event.
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"] == [s.events[-2][1]["item"]]
    assert final["output"][0]["content"][0]["text"] == s.text()
    assert s.events[-4][1]["text"] == s.text()
    use = final["usage"]
    assert use["output_tokens"] == 12 and use["total_tokens"] == use["input_tokens"] + 12
    assert use["input_tokens_details"]["cached_tokens"] >= 0
    assert use["output_tokens_details"]["reasoning_tokens"] == 0


def test_non_streaming_object_and_a_natural_end(sim: Part) -> None:
    out = respond(sim, input=QUESTION, max_output_tokens=10, temperature=0)
    assert out["object"] == "response" and out["id"].startswith("resp_")
    assert out["status"] == "incomplete" and out["max_output_tokens"] == 10
    assert out["usage"]["output_tokens"] == 10 and out["temperature"] == 0.0
    [item] = out["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "completed" and item["id"].startswith("msg_")
    assert item["content"][0]["type"] == "output_text"
    # A stop string ends it before the limit: "completed", no incomplete_details.
    text = item["content"][0]["text"]
    stop = text.strip()[:2]
    done = respond(sim, input=QUESTION, max_output_tokens=10, stop=[stop])
    assert done["status"] == "completed" and done["incomplete_details"] is None
    # (An empty text has no content part at all, as in vLLM.)
    assert all(stop not in part["text"] for part in done["output"][0]["content"])


def test_responses_text_equals_chat_for_the_same_messages(sim: Part) -> None:
    """Same messages, same tokens (greedy): what lets a router resume a Responses
    stream through /v1/completions token ids."""
    want = chat(sim, MSGS, 24)["choices"][0]["message"]["content"]
    parts = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    s = sse(sim.ready + "/v1/responses",
            {"instructions": "Be brief.", "input": parts, "max_output_tokens": 24})  # fmt: skip
    assert s.text() == want
    items = [{"type": "message", "role": "system", "content": "Be brief."},
             {"type": "message", "role": "user", "content": QUESTION}]  # fmt: skip
    full = respond(sim, input=items, max_output_tokens=24, enable_response_messages=True)
    assert full["output"][0]["content"][0]["text"] == want
    # The raw prompt and output token ids, as vLLM reports them on request.
    status, tok = call(sim, "POST", "/tokenize", {"model": MODEL, "messages": MSGS})
    assert status == 200 and full["input_messages"][0]["tokens"] == tok["tokens"]
    assert len(full["output_messages"][0]["tokens"]) == 24


def test_multibyte_text_is_whole_in_every_delta(byte_sim: Part) -> None:
    msgs = [{"role": "user", "content": "Écris-moi quelque chose: 中文 😀"}]
    want = chat(byte_sim, msgs, 200)["choices"][0]["message"]["content"]
    s = sse(byte_sim.ready + "/v1/responses", {"input": msgs, "max_output_tokens": 200})
    deltas = [d["delta"] for t, d in s.events if t == "response.output_text.delta"]
    assert s.text() == want and any(not c.isascii() for c in want)
    assert all(d and not d.endswith("\ufffd") for d in deltas)
    assert s.last()["response"]["usage"]["output_tokens"] == 200
    assert len(deltas) < 200  # tokens holding half a character sent no event


# -- the store ------------------------------------------------------------------------
def test_store_retrieve_follow_up_and_delete(sim: Part) -> None:
    first = respond(sim, input="Name a colour.", instructions="Answer in French.",
                    max_output_tokens=8)  # fmt: skip
    rid = first["id"]
    assert call(sim, "GET", f"/v1/responses/{rid}") == (200, first)
    # The follow-up sees the first turn's input and output, without its instructions.
    answer = first["output"][0]["content"][0]["text"]
    follow = respond(sim, input="Another.", previous_response_id=rid, max_output_tokens=8)
    assert follow["previous_response_id"] == rid and follow["instructions"] is None
    history = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": answer}, {"role": "user", "content": "Another."}]
    assert follow["output"][0]["content"][0]["text"] == (
        chat(sim, history, 8)["choices"][0]["message"]["content"]
    )
    # A streamed response is stored too, as its final object.
    s = sse(sim.ready + "/v1/responses", {"input": "hi", "max_output_tokens": 4})
    assert call(sim, "GET", f"/v1/responses/{s.last()['response']['id']}")[1] == (
        s.last()["response"]
    )
    # store=false keeps nothing.
    gone = respond(sim, input="secret", store=False, max_output_tokens=2)["id"]
    assert call(sim, "GET", f"/v1/responses/{gone}")[0] == 404
    assert call(sim, "POST", f"/v1/responses/{rid}/cancel") == (400, {"error": {
        "message": "Cannot cancel a synchronous response.", "type": "invalid_request_error",
        "param": "response_id", "code": 400}})  # fmt: skip
    assert call(sim, "DELETE", f"/v1/responses/{rid}") == (
        200, {"id": rid, "object": "response", "deleted": True}
    )
    assert call(sim, "GET", f"/v1/responses/{rid}")[0] == 404


@pytest.mark.parametrize("how", ["get", "cancel", "previous"])
def test_unknown_ids_are_vllms_404(sim: Part, how: str) -> None:
    rid = "resp_unknown"
    if how == "get":
        status, body = call(sim, "GET", f"/v1/responses/{rid}")
    elif how == "cancel":
        status, body = call(sim, "POST", f"/v1/responses/{rid}/cancel")
    else:
        status, body = call(sim, "POST", "/v1/responses",
                            {"input": "x", "previous_response_id": rid})  # fmt: skip
    assert status == 404
    assert body == {"error": {"message": f"Response with id '{rid}' not found.",
                              "type": "invalid_request_error", "param": "response_id",
                              "code": 404}}  # fmt: skip


def test_store_off_is_vllms_default_and_delete_is_not_a_vllm_route(byte_sim: Part) -> None:
    rid = respond(byte_sim, input="hi", max_output_tokens=2)["id"]  # store defaults to true
    assert call(byte_sim, "GET", f"/v1/responses/{rid}")[0] == 404
    assert call(byte_sim, "POST", "/v1/responses",
                {"input": "x", "previous_response_id": rid})[0] == 404  # fmt: skip
    assert call(byte_sim, "DELETE", f"/v1/responses/{rid}")[0] == 405


# -- faults -----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["die-after=5", "reset-after=5", "error-after=5"])
def test_a_fault_cuts_a_responses_stream_mid_way(sim: Part, spec: str) -> None:
    body = {"input": QUESTION, "max_output_tokens": 20}
    s = sse(sim.ready + "/v1/responses", body, {"X-Sim-Fault": spec})
    assert s.status == 200 and s.broken is not None
    assert s.types.count("response.output_text.delta") == 5
    assert "response.completed" not in s.types and s.other == []


def test_abort_closes_the_item_and_completes(sim: Part) -> None:
    body = {"input": QUESTION, "max_output_tokens": 20}
    s = sse(sim.ready + "/v1/responses", body, {"X-Sim-Fault": "abort-after=3"})
    assert s.broken is None and s.types[-4:] == CLOSING
    assert s.last()["response"]["status"] == "completed"
    assert s.last()["response"]["usage"]["output_tokens"] == 3


def test_sigkill_mid_responses_stream() -> None:
    p = start_sim("--fault", "exit-after=4")
    try:
        s = sse(p.ready + "/v1/responses", {"input": QUESTION, "max_output_tokens": 20})
        assert s.broken is not None and s.types.count("response.output_text.delta") == 4
        p.proc.wait(5)
        assert not p.alive
    finally:
        p.kill(signal.SIGKILL)


# -- pooling and models -------------------------------------------------------------------
def test_embeddings_are_deterministic_across_replicas(sim: Part) -> None:
    other = start_sim("--chip-seed", "7")
    try:
        body = {"model": MODEL, "input": ["a router", "a router", "bananas"]}
        a = call(sim, "POST", "/v1/embeddings", body)
        b = call(other, "POST", "/v1/embeddings", body)
    finally:
        other.stop(grace=3)
    assert a[0] == b[0] == 200
    va, vb = [d["embedding"] for d in a[1]["data"]], [d["embedding"] for d in b[1]["data"]]
    assert va == vb and va[0] == va[1] != va[2]
    assert len(va[0]) == 128 and abs(sum(x * x for x in va[0]) - 1) < 1e-5
    assert a[1]["object"] == "list" and a[1]["id"].startswith("embd-")
    assert [d["index"] for d in a[1]["data"]] == [0, 1, 2]
    assert a[1]["usage"]["prompt_tokens"] == a[1]["usage"]["total_tokens"] > 0
    # Token ids, dimensions, base64 (little-endian float32, the OpenAI client's decoding).
    ids = call(sim, "POST", "/tokenize", {"prompt": "a router"})[1]["tokens"]
    by_ids = call(sim, "POST", "/v1/embeddings", {"input": [ids]})[1]["data"][0]["embedding"]
    assert by_ids == va[0]
    body = {"input": "a router", "dimensions": 8, "encoding_format": "base64"}
    small = call(sim, "POST", "/v1/embeddings", body)[1]
    vec = struct.unpack("<8f", base64.b64decode(small["data"][0]["embedding"]))
    assert abs(sum(x * x for x in vec) - 1) < 1e-5


def test_score_and_rerank(sim: Part) -> None:
    status, sc = call(sim, "POST", "/v1/score",
                      {"text_1": "a cat sat", "text_2": ["a cat sat", "dogs run far"]})  # fmt: skip
    assert status == 200 and sc["object"] == "list" and sc["id"].startswith("score-")
    scores = [d["score"] for d in sc["data"]]
    assert [d["object"] for d in sc["data"]] == ["score", "score"]
    assert 0 <= scores[1] < scores[0] <= 1
    docs = ["dogs run far", "a cat sat", "the cat"]
    for path in ("/rerank", "/v1/rerank"):
        status, rr = call(sim, "POST", path, {"query": "a cat sat", "documents": docs, "top_n": 2})
        assert status == 200 and len(rr["results"]) == 2
        best = rr["results"][0]
        assert best["index"] == 1 and best["document"]["text"] == "a cat sat"
        assert best["relevance_score"] >= rr["results"][1]["relevance_score"]
        assert rr["usage"]["prompt_tokens"] == rr["usage"]["total_tokens"] > 0
    assert len(call(sim, "POST", "/rerank", {"query": "q", "documents": docs})[1]["results"]) == 3


def test_models_card_carries_max_model_len(sim: Part) -> None:
    status, body = call(sim, "GET", "/v1/models")
    assert status == 200 and body["data"][0]["max_model_len"] == 8192


# -- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", b"{not json", None),
        ("/v1/responses", [1, 2], None),
        ("/v1/responses", {}, "input"),
        ("/v1/responses", {"input": 5}, "input"),
        ("/v1/responses", {"input": [{"type": "input_image"}]}, "input"),
        ("/v1/responses", {"input": [{"role": "pirate", "content": "arr"}]}, "input"),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input"),
        ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ("/v1/responses", {"input": "x", "temperature": "hot"}, "temperature"),
        ("/v1/responses", {"input": "x", "stream": "yes"}, "stream"),
        ("/v1/responses", {"input": "x", "background": True}, "background"),
        ("/v1/responses", {"input": "x" * 9000}, "input"),
        ("/v1/embeddings", {}, "input"),
        ("/v1/embeddings", {"input": [[1, "a"]]}, "input"),
        ("/v1/embeddings", {"input": [[10**9]]}, "input"),
        ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, None),
        ("/v1/score", {"text_1": "a"}, "text_1"),
        ("/rerank", {"query": 3, "documents": ["a"]}, "query"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ],
)
def test_bad_input_is_a_vllm_shaped_400(sim: Part, path: str, body: Any, param: str | None) -> None:
    status, out = call(sim, "POST", path, body)
    assert status == 400, out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["code"] == 400 and out["error"]["param"] == param
    assert call(sim, "GET", "/health")[0] == 200  # still serving


def test_openai_sdk_reads_the_responses_shapes(sim: Part) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=sim.ready + "/v1", api_key="x", max_retries=0, timeout=10)
    full = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10)
    assert full.id.startswith("resp_") and full.status == "incomplete"
    assert full.usage is not None and full.usage.output_tokens == 10
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10,
                                          stream=True))  # fmt: skip
    assert [e.type for e in events[:2]] == EVENT_ORDER[:2]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == full.output_text
    got = client.responses.retrieve(full.id)
    assert got.output_text == full.output_text
