"""An engine's chunk is read once, typed (dataplane/upstream/chunks.py): what the shim reads
of it with the wrong type is garbage (the stream fails over), never an exception that would
cut the client's stream, and an in-band error is an error event."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from baton.model import Failure
from dataplane.upstream.chunks import parse_chunk


def choice(**fields: Any) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}, **fields}]}


@pytest.mark.parametrize(
    "chunk",
    [
        choice(token_ids=[1, True]),  # JSON's true is no token id
        choice(token_ids=[1.0]),
        choice(token_ids=[-1]),  # ids are held 4 bytes each: outside that is no token id
        choice(token_ids=[2**32]),
        {"prompt_token_ids": [1, 2**40], "choices": []},
        choice(token_ids="12"),
        choice(prompt_token_ids=[None]),
        choice(index=1),  # a one-choice request
        choice(index=-1),
        choice(index="0"),
        choice(finish_reason=1),
        choice(text=["a"]),
        choice(delta={"content": 5}),
        choice(delta=["a"]),
        {"choices": {"0": {}}},
        {"choices": ["a"]},
        {"choices": [], "usage": {"prompt_tokens": "3"}},
        {"choices": [], "usage": [3]},
        {"prompt_token_ids": [1, "2"], "choices": []},
        [1, 2],
        "a chunk",
    ],
)
def test_a_field_of_the_wrong_type_is_garbage(chunk: Any) -> None:
    assert parse_chunk(orjson.dumps(chunk), 1) == (None, Failure.GARBAGE)


@pytest.mark.parametrize("data", [b"{", b'{"a":"\\ud800"}', b'{"choices":[]} x', b"\xff"])
def test_bad_json_is_garbage(data: bytes) -> None:
    assert parse_chunk(data, 1) == (None, Failure.GARBAGE)


def test_an_in_band_error_is_an_error_event_unless_it_carries_choices() -> None:
    error = {"error": {"type": "InternalServerError", "message": "boom"}}
    assert parse_chunk(orjson.dumps(error), 1) == (None, Failure.ERROR_EVENT)
    chunk, failure = parse_chunk(orjson.dumps({**choice(), "error": None}), 1)
    assert failure is None and chunk is not None and chunk.choices


def test_what_the_shim_reads_comes_through_and_the_rest_is_left_alone() -> None:
    sent = {
        "id": "chatcmpl-1", "created": 1.5, "model": "m", "system_fingerprint": "fp",
        "prompt_token_ids": [1, 2],
        "choices": [{"index": 1, "delta": {"content": "é", "role": "assistant", "x": [1]},
                     "finish_reason": "stop", "stop_reason": 7, "token_ids": [3, 4],
                     "logprobs": {"content": []}, "unknown": {"deep": True}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2},
    }  # fmt: skip
    chunk, failure = parse_chunk(orjson.dumps(sent), 2)
    assert failure is None and chunk is not None and chunk.choices is not None
    (ch,) = chunk.choices
    assert (chunk.id, chunk.created, chunk.prompt_token_ids) == ("chatcmpl-1", 1.5, [1, 2])
    assert (ch.index, ch.delta, ch.finish_reason, ch.stop_reason, ch.token_ids) == (
        1, sent["choices"][0]["delta"], "stop", 7, [3, 4],
    )  # fmt: skip
    assert chunk.usage == sent["usage"]
