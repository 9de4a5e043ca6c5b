"""strip_ids (dataplane/relay/strip.py): the ids Baton asked for leave the engine's bytes and
nothing else does; where they can't be cut out as bytes, the caller is told."""

from __future__ import annotations

import orjson
import pytest

from dataplane.relay.strip import strip_ids


def chunk(**choice: object) -> bytes:
    body = {"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}, **choice}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (chunk(token_ids=[5, 6]), chunk()),
        (chunk(token_ids=[]), chunk()),
        (chunk(), chunk()),
        (chunk(token_ids=[7], prompt_token_ids=[1, 2]), chunk()),
        (chunk(token_ids=[7], prompt_token_ids=None), chunk()),  # vLLM's later chunks
        (chunk(token_ids=[7]).replace(b'"token_ids":', b'"token_ids" : '), chunk()),
        (chunk(text="[1]", token_ids=[7]), chunk(text="[1]")),
    ],
)
def test_the_ids_leave_and_the_rest_is_the_engines_bytes(raw: bytes, want: bytes) -> None:
    assert strip_ids(raw) == want


def test_text_that_names_the_field_is_left_to_the_caller() -> None:
    # `"token_ids"` inside the text is escaped (\"), so no byte-level cut may touch it: the
    # caller edits the parsed chunk instead.
    raw = chunk(delta={"content": '"token_ids":[1]'}, token_ids=[7])
    assert strip_ids(raw) is None
