"""Tool calls and failover, on sims that really make them (`--tool-calls`: vLLM's hermes
parser). A resume runs on /v1/completions, which has no tool parser, so a tool call after the
seam would reach the client as content: Baton refuses to resume a stream whose request offers
tools (tool_choice not "none") and sends an SSE error event instead. A cut proxy fails one
stream at each position in turn, before the call and inside it; the client never sees the
call's markup as content. Without a cut, the tool-call deltas pass through Baton as the engine
sent them; with tool_choice "none" there is no call and a cut resumes byte for byte."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.factories import sdk
from tests.integration.harness import MODEL
from tests.integration.test_seam_bytes import BytesFleet, seam_fleet

pytestmark = pytest.mark.timeout(300)

# Byte-level: the content before the call has characters cut across tokens (held back).
TOOLS_SIM = ("--tool-calls", "--tool-call-after", "12", "--byte-level")
TOKENS = 60  # room for the whole call: it ends with EOS well before this
MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")
TAG = "<tool_call>"


@pytest.fixture(scope="module")
def tf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BytesFleet]:
    with seam_fleet(tmp_path_factory.mktemp("tools"), TOOLS_SIM) as f:
        yield f


def read(c: openai.OpenAI, **kw: Any) -> tuple[list[Any], openai.APIError | None]:
    """The chunks of a greedy chat stream, and the error that ended it, if any."""
    chunks: list[Any] = []
    try:
        for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, stream=True,  # type: ignore[arg-type]
            max_tokens=TOKENS, **kw,
        ):  # fmt: skip
            chunks.append(ch)
    except openai.APIError as e:
        return chunks, e
    return chunks, None


def content(chunks: list[Any]) -> str:
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def deltas(chunks: list[Any]) -> list[dict[str, Any]]:
    """Each chunk's delta and finish_reason, tool-call ids replaced (they are random)."""
    out = []
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta.model_dump(exclude_unset=True)
        out.append(json.loads(TOOL_ID.sub("ID", json.dumps({**d, "finish": c.finish_reason}))))
    return out


def calls(chunks: list[Any]) -> list[dict[str, Any]]:
    return [tc for d in deltas(chunks) for tc in d.get("tool_calls") or ()]


def reference(tf: BytesFleet, **kw: Any) -> tuple[list[Any], list[int]]:
    """The uninterrupted stream straight from a sim, and its token ids."""
    chunks, err = read(sdk(tf.ref.ready + "/v1"), extra_body={"return_token_ids": True}, **kw)
    assert err is None
    ids = [t for ch in chunks if ch.choices
           for t in (ch.choices[0].model_extra or {}).get("token_ids") or []]  # fmt: skip
    return chunks, ids


@pytest.mark.parametrize("mode", ["parallel", "inline"])
def test_a_cut_anywhere_in_a_tools_stream_is_refused_never_relabelled(
    tf: BytesFleet, mode: str
) -> None:
    ref, ids = reference(tf, tools=[WEATHER])
    want = content(ref)
    want_calls = calls(ref)
    assert want and want_calls and ref[-1].choices[0].finish_reason == "tool_calls"
    assert "\ufffd" not in want[-1:] and TAG not in want
    call_at = ids.index(tag_id(tf))  # where <tool_call> is: the call starts after it
    assert call_at >= 12
    before = len(tf.admin.events(kind="failover", limit=10_000))
    inside = []
    for k in range(1, len(ids)):
        tf.settled(before + k - 1)
        tf.arm.set(k)
        chunks, err = read(tf.client(mode), tools=[WEATHER])
        assert tf.arm.fired.is_set()
        assert err is not None and "tool" in str(err), f"cut after {k}: {err!r}"
        got = content(chunks)
        assert want.startswith(got), f"cut after {k}: {got!r} is not a prefix of {want!r}"
        assert not any(TAG in (d.get("content") or "") for d in deltas(chunks)), k
        got_calls = calls(chunks)
        assert got_calls == want_calls[: len(got_calls)], k  # what went out was the engine's
        assert not any(d["finish"] for d in deltas(chunks)), k  # no silent finish
        if k > call_at:
            inside.append(k)
            assert got == want  # all the content went out before the call started
    # Cuts inside the call, from just after <tool_call> to just before EOS: refused too.
    assert inside == list(range(call_at + 1, len(ids))) and len(inside) >= 20, inside
    tf.settled(before + len(ids) - 1)
    events = tf.admin.events(kind="failover", limit=10_000)[before:]
    assert len(events) == len(ids) - 1
    assert {e["outcome"] for e in events} == {"refused"}, events
    assert all("tool" in e["detail"] for e in events), events


def tag_id(tf: BytesFleet) -> int:
    """<tool_call>'s id in the sims' vocabulary (one added token)."""
    req = urllib.request.Request(
        tf.ref.ready + "/tokenize",
        data=json.dumps({"prompt": TAG, "add_special_tokens": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        (tid,) = json.loads(r.read())["tokens"]
    return int(tid)


@pytest.mark.parametrize("mode", ["parallel", "inline"])
def test_an_uncut_tools_stream_passes_the_tool_calls_through(tf: BytesFleet, mode: str) -> None:
    direct, err = read(sdk(tf.ref.ready + "/v1"), tools=[WEATHER])
    assert err is None
    via, err = read(tf.client(mode), tools=[WEATHER])
    assert err is None
    # Baton asks the engine for token ids, so the engine also sends the chunks its parser
    # has nothing for, with an empty delta (as vLLM does); Baton drops them again, as the
    # client did not ask for ids: chunk for chunk the direct stream.
    assert deltas(via) == deltas(direct)
    (name, *args) = calls(via)
    assert name == {"id": "ID", "type": "function", "index": 0,
                    "function": {"name": "get_weather"}}  # fmt: skip
    arguments = json.loads("".join(a["function"]["arguments"] for a in args))
    assert list(arguments) == ["city"]
    assert via[-1].choices[0].finish_reason == "tool_calls"
    assert TAG not in content(via)


@pytest.mark.parametrize("mode", ["parallel", "inline"])
def test_tool_choice_none_makes_no_call_and_a_cut_resumes_byte_identically(
    tf: BytesFleet, mode: str
) -> None:
    kw: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "none"}
    ref, ids = reference(tf, **kw)
    want = content(ref)
    assert not calls(ref) and TAG not in want and len(ids) == TOKENS
    assert ref[-1].choices[0].finish_reason == "length"
    before = len(tf.admin.events(kind="failover", limit=10_000))
    for k in range(1, TOKENS):
        tf.settled(before + k - 1)
        tf.arm.set(k)
        chunks, err = read(tf.client(mode), **kw)
        assert tf.arm.fired.is_set()
        assert err is None, f"cut after {k}: {err!r}"
        assert content(chunks) == want, f"cut after {k}"
        assert not calls(chunks) and chunks[-1].choices[0].finish_reason == "length"
    tf.settled(before + TOKENS - 1)
    events = tf.admin.events(kind="failover", limit=10_000)[before:]
    assert len(events) == TOKENS - 1
    assert {e["outcome"] for e in events} == {"resumed"}, events
    assert "divergent" not in [e["seam"] for e in events]


def test_the_refusal_is_an_sse_error_event_then_done(tf: BytesFleet) -> None:
    """On the wire: the chunks so far, one OpenAI-shaped error event, then [DONE]."""
    _, ids = reference(tf, tools=[WEATHER])
    call_at = ids.index(tag_id(tf))
    before = len(tf.admin.events(kind="failover", limit=10_000))
    for n, k in enumerate((5, call_at + 3)):  # before the call, and inside it
        tf.settled(before + n)
        tf.arm.set(k)
        body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "stream": True,
                "max_tokens": TOKENS, "tools": [WEATHER]}  # fmt: skip
        req = urllib.request.Request(
            tf.shims["parallel"].ready + "/v1/chat/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            raw = r.read().decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])
        assert set(error) == {"error"} and "tool" in error["error"]["message"], error
        assert {"message", "type", "code"} <= set(error["error"]), error
        chunks = [json.loads(e) for e in events[:-2]]
        assert all("error" not in c for c in chunks) and len(chunks) >= 2, k
        assert not any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks), k
    tf.settled(before + 2)
