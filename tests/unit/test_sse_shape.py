from __future__ import annotations

from dataplane.edge.shape import shape_of
from dataplane.prefix_chain import prefix_chain
from dataplane.request import ClientRequest, Endpoint
from dataplane.sse import SSEParser


def test_events_split_across_arbitrary_chunk_boundaries() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        p = SSEParser()
        events = p.feed(stream[:cut]) + p.feed(stream[cut:])
        assert [e.data for e in events] == [b'{"a":1}', b'{"b":2}', b"", b"[DONE]"]
        assert events[-1].is_done and p.pending == b""
        assert b"".join(e.raw for e in events) == stream


def test_crlf_and_multiline_data_and_truncation() -> None:
    p = SSEParser()
    events = p.feed(b'data: a\r\ndata: b\r\n\r\ndata: {"cut')
    assert [e.data for e in events] == [b"a\nb"]
    assert p.pending == b'data: {"cut'  # EOF here means the stream was cut mid-event


def test_prefix_chain_shares_exactly_the_common_prefix() -> None:
    sys_msg = {"role": "system", "content": "you are terse"}
    a = prefix_chain([sys_msg, {"role": "user", "content": "one"}])
    b = prefix_chain(
        [
            {"content": "you are terse", "role": "system"},  # key order ignored
            {"role": "user", "content": "two"},
        ]
    )
    assert a[0] == b[0] and a[1] != b[1]
    assert prefix_chain([sys_msg], key=b"other")[0] != a[0]


def test_shape_carries_no_text() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "secret words"},
            {"role": "assistant", "content": "ok"},
        ],
        "temperature": 0,
    }
    shape = shape_of(ClientRequest(Endpoint.CHAT, body, "m", False, True))
    assert shape.message_count == 2 and shape.assistant_turns == (False, True)
    assert shape.prompt_chars == len("secret words") + 2
    assert all(b"secret" not in h for h in shape.prefix_chain)
