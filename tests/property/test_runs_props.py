"""A run of chunks taken as one (Stitcher.plain_run, dataplane/relay/runs.py) is only a faster
way to what the chunks give one by one (Stitcher.original): the same bytes for the client,
the same progress (ids, text, boundaries, counts, fingerprint), or else None with nothing
tracked, so the relay offers the run's events one by one. Checked on runs mixing plain
chunks with every kind of chunk that is not plain, and with chunks that look plain to a
byte search but are not (ids out of range, "token_ids" in the text, spaces, wrong types)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.relay.stitch import Stitcher
from dataplane.request import Endpoint
from dataplane.sse import events_of
from tests.factories import client_request

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def choice(chat: bool, text: str, ids: list[int], **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"index": 0, "delta": {"content": text}} if chat else {
        "index": 0, "text": text}  # fmt: skip
    return {**body, "logprobs": None, "finish_reason": None, "token_ids": ids, **more}


def plain(chat: bool) -> st.SearchStrategy[bytes]:
    texts = st.text(max_size=6) | st.sampled_from(["", " wö", "\u4e16", "é", "token_ids"])
    ids = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3)
    return st.builds(lambda t, i: orjson.dumps({**HEAD, "choices": [choice(chat, t, i)]}),
                     texts, ids)  # fmt: skip


def not_plain(chat: bool) -> st.SearchStrategy[bytes]:
    """Chunks the general path must take: each differs from a plain one in one way."""
    c = choice(chat, "x", [5])
    shapes = [
        {**HEAD, "choices": [{**c, "finish_reason": "stop", "stop_reason": None}],
         "system_fingerprint": "fp"},
        {**HEAD, "choices": [{**c, "delta": {"role": "assistant", "content": ""}}],
         "prompt_token_ids": [1, 2]},
        {**HEAD, "choices": [{**c, "delta": {"reasoning": "hm"}}]},
        {**HEAD, "choices": [{**c, "delta": {"content": "x", "tool_calls": []}}]},
        {**HEAD, "choices": [{**c, "delta": {}}]},
        {**HEAD, "choices": [{**c, "token_ids": []}]},
        {**HEAD, "choices": [{**c, "token_ids": None}]},
        {**HEAD, "choices": [{**c, "token_ids": [2**32]}]},
        {**HEAD, "choices": [{**c, "token_ids": [-1]}]},
        {**HEAD, "choices": [{**c, "index": 1}]},
        {**HEAD, "choices": [{**c, "logprobs": {"content": []}}]},
        {**HEAD, "choices": [c, c]},
        {**HEAD, "choices": []},
        {**HEAD, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
        {**HEAD, "choices": [c], "usage": {"prompt_tokens": "1"}},
        {**HEAD, "choices": [c], "usage": {"prompt_tokens": 3}},
        {**HEAD, "choices": [c], "system_fingerprint": "fp2"},
        {**HEAD, "choices": [c], "prompt_token_ids": None},
        {**HEAD, "choices": [{**c, "delta": {"content": 3}} if chat else {**c, "text": 3}]},
        {**HEAD, "choices": [{**c, "text": "t"} if chat else {**c, "delta": {"content": "d"}}]},
        {"error": {"message": "boom", "type": "InternalServerError"}},
    ]
    raw = [orjson.dumps(s) for s in shapes]
    raw += [b"[DONE]", b"{not json", orjson.dumps({**HEAD, "choices": [c]}).replace(b":", b": ")]
    return st.sampled_from(raw)


def events(chat: bool) -> st.SearchStrategy[list[bytes]]:
    """Plain chunks with one that is not plain (or one framed otherwise) among them."""
    framing = st.sampled_from([b"data: %s\n\n", b"data:%s\n\n", b": ping\n\ndata: %s\n\n",
                               b"event: x\ndata: %s\n\n", b"data: %s\n\n"])  # fmt: skip
    odd = st.tuples(framing, plain(chat) | not_plain(chat) | not_plain(chat))
    return st.tuples(st.lists(plain(chat), min_size=1, max_size=10), odd, st.integers(0, 10)).map(
        lambda t: [b"data: %s\n\n" % d for d in t[0][: t[2]]] + [t[1][0] % t[1][1]]
        + [b"data: %s\n\n" % d for d in t[0][t[2] :]]
    )


def started(chat: bool) -> Stitcher:
    """A stitcher past the stream's first chunk (plain_run needs the stream's identity)."""
    s = Stitcher(client_request(Endpoint.CHAT if chat else Endpoint.COMPLETIONS), strip_ids=True)
    first = orjson.dumps({**HEAD, "choices": [choice(chat, "", [1])]})
    s.original(first, b"data: " + first + b"\n\n")
    return s


def state(s: Stitcher) -> tuple[object, ...]:
    p = s.choices[0]
    return (p.ids(), p.text, list(p.settled), p.text_len, p.content_chunks,
            p.untracked_chunks, list(p.recent_text), p.finish_reason,
            s.ident.system_fingerprint, s.usage)  # fmt: skip


def one_by_one(s: Stitcher, run: bytes) -> tuple[bytes, bool]:
    """(the client's bytes, whether every event went out without a failure), as the relay
    offers a block's events to original() (keep-alives skipped)."""
    out, ok = [], True
    for event in events_of(run):
        if event.data:
            piece, failure = s.original(event.data, event.raw)
            out.append(piece or b"")
            ok = ok and failure is None
    return b"".join(out), ok


@settings(max_examples=300, deadline=None)
@given(chat=st.booleans(), data=st.data())
def test_a_run_gives_what_its_chunks_give_one_by_one_or_nothing(chat: bool, data: Any) -> None:
    evs = data.draw(events(chat))
    run = b"".join(evs)
    fast, slow = started(chat), started(chat)
    before = state(fast)
    got = fast.plain_run(run, run.count(b"\n\n"))
    want, ok = one_by_one(slow, run)
    if got is None:
        assert state(fast) == before  # nothing tracked: the relay goes one by one
    else:
        assert ok and got == want and state(fast) == state(slow)


@settings(max_examples=100, deadline=None)
@given(chat=st.booleans(), data=st.data())
def test_a_run_of_plain_chunks_is_taken_as_one(chat: bool, data: Any) -> None:
    """The point of it: plain chunks (text, ids in range, compact JSON) do go as one run."""
    ds = data.draw(st.lists(plain(chat), min_size=2, max_size=40))
    run = b"".join(b"data: %s\n\n" % d for d in ds)
    fast, slow = started(chat), started(chat)
    got = fast.plain_run(run, len(ds))
    want, ok = one_by_one(slow, run)
    key = "delta" if chat else "text"
    texts = [orjson.loads(d)["choices"][0][key] for d in ds]
    text_has_key = any("token_ids" in (t["content"] if chat else t) for t in texts)
    if got is None:
        assert text_has_key  # only a text that itself says "token_ids" keeps it one by one
    else:
        assert ok and got == want and state(fast) == state(slow)
