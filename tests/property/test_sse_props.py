"""The SSE parsers on hostile input: the events of a byte stream do not depend on how the
network cut it into reads, well-formed events round-trip byte for byte, the buffer is
bounded, and a backend stream of any bytes ends in exactly one classified StreamFailed."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.model import Failure
from dataplane.exceptions import StreamFailed
from dataplane.relay.stitch import Stitcher
from dataplane.request import ClientRequest, Endpoint
from dataplane.settings import ResumeSettings
from dataplane.sse import Event, SSEParser
from dataplane.upstream.engine import read_events
from tests.property.strategies import json_values

# Pieces SSE streams are made of, so random streams hit the interesting boundaries often.
atoms = st.sampled_from(
    [b"data: ", b"data:", b"data", b": keep-alive", b"\n", b"\r\n", b"\r", b"\n\n", b"\r\n\r\n",
     b"[DONE]", b'{"a":1}', b"event: x", b"id: 3", b" ", b"\x00", b"\xff"]
)  # fmt: skip
sse_bytes = st.lists(atoms | st.binary(max_size=8), max_size=40).map(b"".join)


def cuts(data: bytes) -> st.SearchStrategy[list[bytes]]:
    """`data` split at any positions (empty reads included)."""
    return st.lists(st.integers(0, len(data)), max_size=12).map(
        lambda points: [
            data[a:b]
            for a, b in zip([0, *sorted(points)], [*sorted(points), len(data)], strict=True)
        ]
    )


def parse_all(pieces: list[bytes], max_event: int = 1 << 20) -> tuple[list[Event], bytes]:
    parser = SSEParser(max_event)
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events, parser.pending


@given(st.data())
def test_any_chunking_yields_the_same_events(data: st.DataObject) -> None:
    stream = data.draw(sse_bytes)
    whole = parse_all([stream])
    assert parse_all(data.draw(cuts(stream))) == whole
    assert parse_all([bytes([b]) for b in stream]) == whole


payloads = st.lists(
    st.binary(max_size=30).filter(lambda b: b"\n" not in b and b"\r" not in b), max_size=8
)


@given(payloads, st.data())
def test_data_events_round_trip_byte_for_byte(items: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(b"data: " + p + b"\n\n" for p in items)
    events, pending = parse_all(data.draw(cuts(stream)))
    assert [e.data for e in events] == items
    # The relay forwards raw bytes untouched: they must be exactly what the backend sent.
    assert b"".join(e.raw for e in events) == stream and pending == b""


@given(st.lists(payloads, min_size=1, max_size=4), st.booleans())
def test_multi_line_data_is_joined_with_newlines(lines: list[list[bytes]], crlf: bool) -> None:
    eol = b"\r\n" if crlf else b"\n"
    events = [ls for ls in lines if ls]
    stream = b"".join(b"".join(b"data:" + ln + eol for ln in ls) + eol for ls in events)
    got, _ = parse_all([stream])
    # "data:x" and "data: x" both carry x (one leading space is the separator).
    expect = [b"\n".join(ln[1:] if ln.startswith(b" ") else ln for ln in ls) for ls in events]
    assert [e.data for e in got] == expect


@given(st.integers(16, 64), st.integers(0, 100), st.data())
def test_an_event_over_the_limit_is_refused_however_it_arrives(
    limit: int, size: int, data: st.DataObject
) -> None:
    stream = b"data: " + b"x" * size + b"\n\ndata: [DONE]\n\n"
    pieces = data.draw(cuts(stream))
    too_big = len(b"data: ") + size > limit
    try:
        events, pending = parse_all(pieces, limit)
    except ValueError:
        assert too_big
        return
    assert not too_big and [e.data for e in events] == [b"x" * size, b"[DONE]"]
    assert len(pending) <= limit


# -- read_events over a real aiohttp StreamReader ---------------------------------------------


async def _drain(pieces: list[bytes], eof: bool) -> tuple[list[bytes], str]:
    proto = mock.Mock(_reading_paused=False)
    reader = aiohttp.StreamReader(proto, 1 << 16, loop=asyncio.get_running_loop())
    for piece in pieces:
        if piece:
            reader.feed_data(piece)
    if eof:
        reader.feed_eof()
    else:
        reader.set_exception(aiohttp.ClientPayloadError("connection reset"))
    settings = ResumeSettings(first_token_timeout=5, inter_token_timeout=5)
    got: list[bytes] = []
    try:
        async for events in read_events(reader, b"", settings, False):
            got += [e.data for e in events]
            if got and got[-1] == b"[DONE]":
                return got, "done"
    except StreamFailed as failed:
        return got, failed.failure
    raise AssertionError("read_events ended without [DONE] and without StreamFailed")


@settings(max_examples=100)
@given(st.data(), st.booleans())
def test_a_backend_stream_ends_in_done_or_one_classified_failure(
    data: st.DataObject, eof: bool
) -> None:
    stream = data.draw(sse_bytes)
    got, end = asyncio.run(_drain(data.draw(cuts(stream)), eof))
    whole = [e.data for e in parse_all([stream])[0] if e.data]
    # Never invented, never reordered: what came out is what the bytes said, up to the end.
    assert got == whole[: len(got)]
    if end != "done":
        assert end == (Failure.TRUNCATED if eof else Failure.DISCONNECT)


# -- the stitcher reading the first backend's events ---------------------------------------------

CHAT = ClientRequest(Endpoint.CHAT, {"model": "m", "messages": [], "stream": True}, "m", True, True)
COMP = ClientRequest(Endpoint.COMPLETIONS, {"model": "m", "prompt": "p", "n": 2}, "m", True, False)
chunk_like = st.fixed_dictionaries(
    {},
    optional={
        "id": json_values, "created": json_values, "model": json_values,
        "system_fingerprint": json_values, "prompt_token_ids": json_values, "usage": json_values,
        "error": json_values,
        "choices": json_values | st.lists(
            st.fixed_dictionaries({}, optional={
                "index": json_values, "delta": json_values, "text": json_values,
                "token_ids": json_values, "finish_reason": json_values,
                "prompt_token_ids": json_values, "stop_reason": json_values,
            }),
            max_size=3,
        ),
    },
)  # fmt: skip


@settings(max_examples=300)
@given(st.lists(chunk_like | json_values, min_size=1, max_size=4), st.sampled_from([CHAT, COMP]))
def test_any_backend_chunk_is_relayed_or_classified_never_a_crash(
    chunks: list[Any], client: ClientRequest
) -> None:
    """A chunk of the wrong shape must come out as a failure class (so the stream fails over
    or ends with an error event); an exception here would cut the client's stream."""
    stitcher = Stitcher(client, strip_ids=True)
    for obj in chunks:
        data = orjson.dumps(obj)
        out, failure = stitcher.original(data, b"data: " + data + b"\n\n")
        assert out is None or out.startswith(b"data: ")
        assert failure is None or isinstance(failure, str)
        if failure is not None:
            break
    for p in stitcher.choices.values():
        assert isinstance(p.text, str) and all(isinstance(t, int) for t in p.token_ids)


@pytest.mark.parametrize(
    "stream", [b"data: {this is not json\n\nevent: ???\n\n\x00\xff garbage\n\ndata: [[[\n\n"]
)
def test_the_sims_garbage_is_classified_as_garbage(stream: bytes) -> None:
    stitcher = Stitcher(CHAT, strip_ids=True)
    events, _ = parse_all([stream])
    first = next(e for e in events if e.data)
    assert stitcher.original(first.data, first.raw) == (None, Failure.GARBAGE)
