from __future__ import annotations

import orjson
import pytest

from dataplane.apis.table import parse_request
from dataplane.exceptions import ErrorKind, OpenAIError
from dataplane.request import Endpoint

CHAT = Endpoint.CHAT
COMP = Endpoint.COMPLETIONS
MSGS = [{"role": "user", "content": "hi"}]


def parse(body: object, endpoint: Endpoint = CHAT, limit: int = 10_000):  # type: ignore[no-untyped-def]
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(raw, endpoint, limit)


@pytest.mark.parametrize(
    ("body", "endpoint", "kind", "status", "param"),
    [
        (b"{not json", CHAT, ErrorKind.INVALID_JSON, 400, None),
        (b"[1,2]", CHAT, ErrorKind.INVALID_REQUEST, 400, None),
        ({"messages": MSGS}, CHAT, ErrorKind.INVALID_REQUEST, 400, "model"),
        ({"model": 3, "messages": MSGS}, CHAT, ErrorKind.INVALID_REQUEST, 400, "model"),
        ({"model": "m" * 257, "messages": MSGS}, CHAT, ErrorKind.INVALID_REQUEST, 400, "model"),
        ({"model": "m" * 257, "input": [1]}, Endpoint.EMBEDDINGS, ErrorKind.INVALID_REQUEST, 400,
         "model"),  # fmt: skip
        ({"model": "m"}, CHAT, ErrorKind.INVALID_REQUEST, 400, "messages"),
        ({"model": "m", "messages": []}, CHAT, ErrorKind.INVALID_REQUEST, 400, "messages"),
        ({"model": "m", "messages": "hi"}, CHAT, ErrorKind.INVALID_REQUEST, 400, "messages"),
        (
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            CHAT,
            ErrorKind.INVALID_REQUEST,
            400,
            "messages[0].role",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": 5}]},
            CHAT,
            ErrorKind.INVALID_REQUEST,
            400,
            "messages[0].content",
        ),
        (
            {"model": "m", "messages": MSGS, "max_tokens": "10"},
            CHAT,
            ErrorKind.INVALID_REQUEST,
            400,
            "max_tokens",
        ),
        (
            {"model": "m", "messages": MSGS, "max_tokens": 0},
            CHAT,
            ErrorKind.INVALID_REQUEST,
            400,
            "max_tokens",
        ),
        (
            {"model": "m", "messages": MSGS, "temperature": "hot"},
            CHAT,
            ErrorKind.INVALID_REQUEST,
            400,
            "temperature",
        ),
        (
            {"model": "m", "messages": MSGS, "stream": "yes"},
            CHAT,
            ErrorKind.INVALID_REQUEST,
            400,
            "stream",
        ),
        (
            {"model": "m", "messages": MSGS, "stop": [1]},
            CHAT,
            ErrorKind.INVALID_REQUEST,
            400,
            "stop",
        ),
        ({"model": "m", "messages": MSGS, "n": True}, CHAT, ErrorKind.INVALID_REQUEST, 400, "n"),
        ({"model": "m"}, COMP, ErrorKind.INVALID_REQUEST, 400, "prompt"),
        ({"model": "m", "prompt": 12}, COMP, ErrorKind.INVALID_REQUEST, 400, "prompt"),
        ({"model": "m", "prompt": [1, "a"]}, COMP, ErrorKind.INVALID_REQUEST, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(body, endpoint, kind, status, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OpenAIError) as info:
        parse(body, endpoint)
    err = info.value
    assert (err.kind, err.status, err.param) == (kind, status, param)
    shape = err.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}  # type: ignore[arg-type]


def test_body_over_the_limit_is_413() -> None:
    with pytest.raises(OpenAIError) as info:
        parse({"model": "m", "messages": [{"role": "user", "content": "x" * 200}]}, limit=100)
    assert info.value.status == 413


@pytest.mark.parametrize(
    ("body", "endpoint", "stream", "greedy"),
    [
        ({"model": "m", "messages": MSGS}, CHAT, False, False),
        ({"model": "m", "messages": MSGS, "stream": True, "temperature": 0}, CHAT, True, True),
        ({"model": "m", "prompt": "hi", "temperature": 0.7}, COMP, False, False),
        ({"model": "m", "prompt": [1, 2, 3], "temperature": 0.0}, COMP, False, True),
        ({"model": "m", "prompt": ["a", "b"]}, COMP, False, False),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            },
            CHAT,
            False,
            False,
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
            },
            CHAT,
            False,
            False,
        ),
    ],
)
def test_good_requests(body, endpoint, stream, greedy) -> None:  # type: ignore[no-untyped-def]
    req = parse(body, endpoint)
    assert (req.model, req.stream, req.greedy) == ("m", stream, greedy)
