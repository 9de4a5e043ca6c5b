"""The request validator on hostile input: whatever the bytes, it answers a ClientRequest or
its own OpenAIError with a 4xx in OpenAI's shape, and what it accepts never crashes the pure
code that reads the request afterwards (shape, resume planning, stitching)."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.apis.table import parse_request
from dataplane.edge.shape import shape_of
from dataplane.exceptions import OpenAIError, Refused
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume.plan import plan_resume, static_refusal
from dataplane.relay.stitch import Stitcher
from dataplane.request import ClientRequest, Endpoint
from tests.property.strategies import json_values, mutated_body, valid_body

LIMIT = 64 * 1024
# The generation endpoints whose bodies the strategies build (chat or completion shapes);
# the Responses API and one-shot calls have their own table tests (test_responses_request,
# test_oneshot) and their own fuzz below.
GENERATING = [Endpoint.CHAT, Endpoint.COMPLETIONS]
endpoints = st.sampled_from(GENERATING)


def check_error(err: OpenAIError) -> None:
    """What an OpenAI SDK needs to raise the right exception with a useful message."""
    assert 400 <= err.status < 500
    body = orjson.loads(err.json())
    assert set(body) == {"error"}
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert isinstance(e["message"], str) and e["message"]
    assert e["type"] == "invalid_request_error"
    assert e["param"] is None or isinstance(e["param"], str)
    sse = err.sse()
    assert sse.startswith(b"data: {") and sse.endswith(b"data: [DONE]\n\n")


def downstream(req: ClientRequest) -> None:
    """Everything pure that reads an accepted request must cope with it."""
    before = copy.deepcopy(req.body)
    shape = shape_of(req)
    assert shape.model == req.model and shape.message_count == len(shape.prefix_chain) >= 1
    static_refusal(req.body)
    stitcher = Stitcher(req, strip_ids=True)
    assert stitcher.unfinished()
    for progress in (ChoiceProgress(0), _progress_with_text()):
        for token_path in (False, True):
            try:
                plan_resume(req, progress, token_path=token_path, seam_tokens=2)
            except Refused:
                pass
    assert req.body == before, "planning must not mutate the client's request"


def _progress_with_text() -> ChoiceProgress:
    p = ChoiceProgress(0, [1, 2, 3])
    for i in range(3):
        p.add(f"w{i} ", [10 + i])
    return p


def run(raw: bytes, endpoint: Endpoint) -> ClientRequest | None:
    try:
        req = parse_request(raw, endpoint, LIMIT)
    except OpenAIError as err:
        check_error(err)
        return None
    assert isinstance(req.model, str) and req.model
    assert req.endpoint is endpoint
    downstream(req)
    return req


@given(st.binary(max_size=200), endpoints)
def test_any_bytes_get_a_request_or_an_openai_4xx(raw: bytes, endpoint: Endpoint) -> None:
    run(raw, endpoint)


@given(json_values, endpoints)
def test_any_json_gets_a_request_or_an_openai_4xx(value: Any, endpoint: Endpoint) -> None:
    assert run(orjson.dumps(value), endpoint) is None or isinstance(value, dict)


@pytest.mark.parametrize("endpoint", GENERATING)
@settings(max_examples=300)
@given(data=st.data())
def test_nearly_valid_bodies_never_crash_anything(endpoint: Endpoint, data: st.DataObject) -> None:
    body = data.draw(mutated_body(endpoint is Endpoint.CHAT))
    req = run(orjson.dumps(body), endpoint)
    if req is None:
        return
    # Accepted: the fields the shim itself reads have the types it relies on.
    assert isinstance(req.stream, bool)
    assert req.stream == bool(body.get("stream"))
    for name in ("max_tokens", "max_completion_tokens", "n", "min_tokens", "best_of"):
        v = body.get(name)
        assert v is None or (type(v) is int and v >= 0), (name, v)


@given(st.data())
def test_valid_bodies_are_accepted_as_sent(data: st.DataObject) -> None:
    endpoint = data.draw(endpoints)
    body = data.draw(valid_body(endpoint is Endpoint.CHAT))
    req = run(orjson.dumps(body), endpoint)
    assert req is not None
    assert req.body == body and req.model == body["model"]
    assert req.greedy == (body.get("temperature") == 0)


@given(st.data())
def test_rejections_name_the_parameter_at_fault(data: st.DataObject) -> None:
    endpoint = data.draw(endpoints)
    body = data.draw(mutated_body(endpoint is Endpoint.CHAT))
    try:
        parse_request(orjson.dumps(body), endpoint, LIMIT)
    except OpenAIError as err:
        if err.param is not None:
            root = err.param.split("[")[0].split(".")[0]
            # Either a field the client sent, or a required one it left out.
            assert root in body or root in ("model", "messages", "prompt"), err.param


@pytest.mark.parametrize("endpoint", [e for e in Endpoint if e not in GENERATING])
@settings(max_examples=200)
@given(value=json_values)
def test_other_endpoints_get_a_request_or_an_openai_4xx_and_never_crash(
    endpoint: Endpoint, value: Any
) -> None:
    """Any JSON to the Responses API or a one-shot call: an accepted request whose shape can
    be taken, or an OpenAI-shaped 4xx."""
    try:
        req = parse_request(orjson.dumps(value), endpoint, LIMIT)
    except OpenAIError as err:
        check_error(err)
        return
    assert isinstance(value, dict) and req.endpoint is endpoint and req.model == value["model"]
    shape = shape_of(req)
    assert shape.model == req.model
    if endpoint is not Endpoint.RESPONSES:
        assert shape.prefix_chain == () and not req.stream  # never pinned, never streamed


@pytest.mark.parametrize("size", [LIMIT + 1, 10 * LIMIT])
def test_bodies_over_the_limit_are_413_whatever_they_contain(size: int) -> None:
    with pytest.raises(OpenAIError) as info:
        parse_request(b"{" * size, Endpoint.CHAT, LIMIT)
    assert info.value.status == 413
    check_error(info.value)


# Bodies hypothesis found that once crashed the shim after validation (a 500, or a stream cut
# at failover): kept as fixed cases so fewer random examples still cover them.
FOUND = [
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": "", "best_of": [None]}),
    (Endpoint.COMPLETIONS, {"model": "m", "prompt": "", "min_tokens": [None]}),
    (
        Endpoint.CHAT,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    ),
    (
        Endpoint.CHAT,
        {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}, "text": None}
        ]}]},
    ),
    (
        Endpoint.CHAT,
        {"model": "m", "continue_final_message": True, "messages": [
            {"role": "assistant", "content": [{"type": "text", "text": "prefill "}]}
        ]},
    ),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body"), FOUND)
def test_bodies_that_once_crashed_the_shim(endpoint: Endpoint, body: dict[str, Any]) -> None:
    run(orjson.dumps(body), endpoint)
