"""The lean engine answers in vLLM's shapes, so Baton's shim does its real work against it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from bench.lean_engine import (
    DEFAULT_MAX_TOKENS,
    FIRST_TOKEN_ID,
    Refused,
    Shape,
    encoded_stream,
    encoded_whole,
    shape_of,
)
from dataplane.upstream.chunks import parse_chunk

RID = b"cmpl-0123"


def events(shape: Shape) -> list[dict[str, Any]]:
    out = []
    for pieces in encoded_stream(shape):
        raw = RID.join(pieces)
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        out.append(orjson.loads(raw[len(b"data: ") : -2]))
    return out


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("ids", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_a_stream_is_one_token_per_event_and_baton_reads_every_one(
    chat: bool, ids: bool, usage: bool
) -> None:
    shape = Shape("toy", chat, prompt_tokens=3, max_tokens=4, return_token_ids=ids,
                  include_usage=usage)  # fmt: skip
    got = events(shape)
    assert {e["id"] for e in got} == {RID.decode()}
    for e in got:
        chunk, failure = parse_chunk(orjson.dumps(e), 1)
        assert failure is None and chunk is not None
        assert [c.token_ids for c in chunk.choices or ()] == [
            c.get("token_ids") for c in e.get("choices") or ()
        ]
    if chat:
        role, *got = got
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert role.get("prompt_token_ids") == ([1, 2, 3] if ids else None)
    if usage:
        *got, last = got
        assert last["choices"] == []
        assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    tokens = [e["choices"][0] for e in got]
    assert len(tokens) == 4
    assert [t["finish_reason"] for t in tokens] == [None, None, None, "length"]
    if ids:
        assert [t["token_ids"] for t in tokens] == [[FIRST_TOKEN_ID + i] for i in range(4)]
        # Completions carry the prompt's ids on the choice of the first event only.
        assert [t.get("prompt_token_ids") for t in tokens] == (
            [None] * 4 if chat else [[1, 2, 3], None, None, None]
        )
    else:
        assert not any("token_ids" in t for t in tokens)


@pytest.mark.parametrize("chat", [False, True])
def test_a_whole_answer_has_every_token_and_the_usage(chat: bool) -> None:
    shape = Shape("toy", chat, prompt_tokens=2, max_tokens=3, return_token_ids=True)
    body = orjson.loads(RID.join(encoded_whole(shape)))
    (choice,) = body["choices"]
    text = choice["message"]["content"] if chat else choice["text"]
    assert (body["id"], text, choice["finish_reason"]) == (RID.decode(), " x x x", "length")
    assert choice["token_ids"] == [FIRST_TOKEN_ID, FIRST_TOKEN_ID + 1, FIRST_TOKEN_ID + 2]
    prompt_ids = body["prompt_token_ids"] if chat else choice["prompt_token_ids"]
    assert prompt_ids == [1, 2]
    assert body["usage"]["completion_tokens"] == 3


def test_shape_of_reads_what_the_answer_depends_on() -> None:
    body = {"model": "toy", "prompt": "x" * 40, "max_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    assert shape_of(body, "toy", chat=False) == (Shape("toy", False, 10, 64, True, True), True)
    chat = {"messages": [{"role": "user", "content": "abcdefgh"}], "max_completion_tokens": 2}
    assert shape_of(chat, "toy", chat=True) == (Shape("toy", True, 2, 2), False)
    assert shape_of({"prompt": "hi"}, "toy", chat=False)[0].max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize(
    ("body", "chat", "status"),
    [([1], False, 400), ({"model": "other"}, False, 404), ({"max_tokens": 0}, False, 400),
     ({"max_tokens": True}, False, 400), ({"prompt": "x"}, True, 400)],
)  # fmt: skip
def test_shape_of_refuses_what_vllm_refuses(body: Any, chat: bool, status: int) -> None:
    with pytest.raises(Refused) as caught:
        shape_of(body, "toy", chat)
    assert caught.value.status == status

