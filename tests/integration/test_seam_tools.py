"""Tool calls through a backend's death, on sims that really make them: the tools are
rendered into the prompt, so a resume over /v1/completions makes the same calls, in each of
the four formats Baton follows (`--tool-call-parser`; the backends name the same
`tool_parser`). A cut proxy fails one stream after each token in turn (in the content
before a call, on the start tag, inside a name, inside the arguments mid-string,
mid-character, mid-number and mid-escape, between two parallel calls, on the end tag), and
what the client assembles, as the OpenAI SDK assembles it, must be the uninterrupted
stream's: content, finish_reason, and per call its name and arguments; a call's id is the
one the client got first. One-token and merged chunks (stream_interval 3), both seam modes.

A backend that names no tool_parser is refused a resume, explicitly, as before."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.factories import sdk
from tests.integration.harness import MODEL
from tests.integration.test_seam_bytes import BytesFleet, seam_fleet

pytestmark = pytest.mark.timeout(900)

PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_xml")
FLAGS = ("--tool-calls", "--tool-call-after", "12", "--parallel-tool-calls", "2", "--byte-level",
         "--instant")
TOKENS = 200  # room for both calls: they end with EOS well before this
MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip
# The text that opens a call, per format: cuts before it are in the content.
OPENS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]",
         "qwen3_xml": "<tool_call>"}  # fmt: skip


@pytest.fixture(scope="module", params=PARSERS)
def tf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
       ) -> Iterator[tuple[str, BytesFleet]]:  # fmt: skip
    parser = request.param
    flags = (*FLAGS, "--tool-call-parser", parser)
    with seam_fleet(tmp_path_factory.mktemp(parser), flags,
                    backend_extra=f'tool_parser = "{parser}"') as f:  # fmt: skip
        yield parser, f


def read(
    c: openai.OpenAI, tools: Any = TOOLS, max_tokens: int = TOKENS, **kw: Any
) -> tuple[list[Any], openai.APIError | None]:
    """The chunks of a greedy chat stream offering `tools` (TOOLS; openai.omit: none), and the
    error that ended it."""
    chunks: list[Any] = []
    try:
        for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, stream=True,  # type: ignore[arg-type]
            max_tokens=max_tokens, tools=tools, **kw,
        ):  # fmt: skip
            chunks.append(ch)
    except openai.APIError as e:
        return chunks, e
    return chunks, None


def assembled(chunks: list[Any]) -> dict[str, Any]:
    """The message as the OpenAI SDK assembles it (ids apart: they are random per stream)."""
    content, finish = "", None
    calls: dict[int, dict[str, str]] = {}
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += (tc.function and tc.function.name) or ""
            call["arguments"] += (tc.function and tc.function.arguments) or ""
        finish = c.finish_reason or finish
    return {"content": content, "finish": finish, "calls": [calls[i] for i in sorted(calls)]}


def ids_sent(chunks: list[Any]) -> dict[int, list[str]]:
    """Per call index, every id a delta gave it: the client must get exactly one."""
    out: dict[int, list[str]] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or ()) if ch.choices else ():
            if tc.id is not None:
                out.setdefault(tc.index, []).append(tc.id)
    return out


def reference(f: BytesFleet, **kw: Any) -> tuple[dict[str, Any], list[int]]:
    chunks, err = read(sdk(f.ref.ready + "/v1"), extra_body={"return_token_ids": True, **kw})
    assert err is None
    ids = [t for ch in chunks if ch.choices
           for t in (ch.choices[0].model_extra or {}).get("token_ids") or []]  # fmt: skip
    return assembled(chunks), ids


def detokenize(f: BytesFleet, ids: list[int]) -> str:
    req = urllib.request.Request(
        f.ref.ready + "/detokenize", data=json.dumps({"tokens": ids}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(json.loads(r.read())["prompt"])


def cut_class(parser: str, before: str) -> str:
    """Where a cut fell, by the raw text the model had written up to it."""
    call = before.rfind(OPENS[parser])
    if call < 0:
        return "content"
    body = before[call + len(OPENS[parser]) :]
    if before.endswith(OPENS[parser]):
        return "start tag"
    if before.endswith("\ufffd"):
        return "mid-character"
    if before.endswith("\\"):
        return "mid-escape"
    if before[-1:].isdigit():
        return "mid-number"
    if before.endswith(('"name": "g', "<function=g")):
        return "name"
    if before.endswith(("</tool_call>", "; ", "}, ")):
        return "between calls"
    if before[-1:].isalpha() and ('"' in body or "<parameter=" in body):
        return "mid-string"
    return "other"


def cuts(classes: list[str], full: bool) -> list[int]:
    """The cut positions (tokens) to try: every one, or the first of each class and every
    12th (the default suite; the full sweep runs under the `matrix` marker)."""
    ks = range(1, len(classes) + 1)
    if full:
        return list(ks)
    picked = {k for k in ks if k % 12 == 0}
    for c in set(classes):
        picked.update([k for k in ks if classes[k - 1] == c][:1])
    return sorted(picked)


CASES = [
    pytest.param("parallel", 1, False, id="parallel-1tok"),
    pytest.param("inline", 3, False, id="inline-merged"),
    pytest.param("parallel", 1, True, id="parallel-1tok-all", marks=pytest.mark.matrix),
    pytest.param("inline", 3, True, id="inline-merged-all", marks=pytest.mark.matrix),
]


@pytest.mark.parametrize(("mode", "interval", "full"), CASES)
def test_every_cut_resumes_to_the_message_an_uninterrupted_stream_assembles(
    tf: tuple[str, BytesFleet], mode: str, interval: int, full: bool
) -> None:
    parser, f = tf
    kw = {"stream_interval": interval} if interval > 1 else {}
    want, ids = reference(f, **kw)
    assert want["finish"] == "tool_calls" and len(want["calls"]) == 2, want
    assert [c["name"] for c in want["calls"]] == ["get_weather", "get_time"]
    assert "é" in json.loads(want["calls"][0]["arguments"])["city"]
    texts = [detokenize(f, ids[:k]) for k in range(1, len(ids))]
    classes = [cut_class(parser, t) for t in texts]
    must = {"start tag", "name", "mid-character", "mid-number", "mid-string", "between calls"}
    if parser != "llama3_json":  # its parser finds a call only where the answer opens
        must.add("content")
    if parser != "qwen3_xml":  # its values are raw text, not JSON strings
        must.add("mid-escape")
    assert must <= set(classes), (parser, sorted(set(classes)))
    client = f.client(mode)  # one client: making an SDK client costs more than a stream
    tried = cuts(classes, full)
    before = len(f.admin.events(kind="failover", limit=10_000))
    for n, k in enumerate(tried):
        f.settled(before + n)
        f.arm.set(k)
        chunks, err = read(client, extra_body=kw)
        where = f"{parser}: cut after {k} tokens, {classes[k - 1]} ({texts[k - 1][-30:]!r})"
        assert f.arm.fired.is_set()
        assert err is None, f"{where}: {err!r}"
        assert assembled(chunks) == want, where
        assert all(len(v) == 1 for v in ids_sent(chunks).values()), (where, ids_sent(chunks))
    f.settled(before + len(tried))
    events = f.admin.events(kind="failover", limit=10_000)[before:]
    assert len(events) == len(tried)
    assert {e["outcome"] for e in events} == {"resumed"}, [
        e["detail"] for e in events if e["outcome"] != "resumed"]  # fmt: skip
    assert "divergent" not in {e["seam"] for e in events}


def test_an_uncut_tools_stream_passes_the_engines_deltas_through(
    tf: tuple[str, BytesFleet],
) -> None:
    parser, f = tf
    direct, err = read(sdk(f.ref.ready + "/v1"))
    assert err is None
    via, err = read(f.client("parallel"))
    assert err is None
    assert assembled(via) == assembled(direct)
    # Chunk for chunk: Baton asked for ids, so the engine also sent the chunks its parser
    # had nothing for (an empty delta); Baton drops them again.
    shape = [(ch.choices[0].delta.content, ch.choices[0].finish_reason,
              len(ch.choices[0].delta.tool_calls or ())) for ch in via if ch.choices]  # fmt: skip
    want = [(ch.choices[0].delta.content, ch.choices[0].finish_reason,
             len(ch.choices[0].delta.tool_calls or ())) for ch in direct if ch.choices]  # fmt: skip
    assert shape == want, parser


@pytest.fixture(scope="module")
def unnamed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BytesFleet]:
    """Backends that name no tool_parser."""
    flags = (*FLAGS, "--tool-call-parser", "hermes")
    with seam_fleet(tmp_path_factory.mktemp("unnamed"), flags) as f:
        yield f


def test_a_backend_that_names_no_tool_parser_is_refused_with_an_error_event(
    unnamed: BytesFleet,
) -> None:
    before = len(unnamed.admin.events(kind="failover", limit=10_000))
    for n, k in enumerate((5, 40)):  # before the call, and inside it
        unnamed.settled(before + n)
        unnamed.arm.set(k)
        chunks, err = read(unnamed.client("parallel"))
        assert unnamed.arm.fired.is_set()
        assert err is not None and "tool" in str(err), err
        assert not any(ch.choices and ch.choices[0].finish_reason for ch in chunks)
    unnamed.settled(before + 2)
    events = unnamed.admin.events(kind="failover", limit=10_000)[before:]
    assert [e["outcome"] for e in events] == ["refused", "refused"], events


# -- Messages and Responses: served as chat, the same calls through the same seams ----------

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": "A tool.",
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip


def message(base: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A greedy streamed Messages answer, as the anthropic SDK assembles it: its stop reason
    and content blocks (tool ids apart)."""
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)
    with client.messages.stream(
        model=MODEL, max_tokens=TOKENS, messages=MESSAGES,  # type: ignore[arg-type]
        tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0},  # type: ignore[arg-type]
    ) as s:  # fmt: skip
        msg = s.get_final_message()
    return msg.stop_reason, [{k: v for k, v in b.model_dump(exclude_none=True).items()
                              if k != "id"} for b in msg.content]  # fmt: skip


def response(c: openai.OpenAI) -> tuple[str, list[dict[str, Any]]]:
    """A greedy streamed Responses answer (store false), as the openai SDK assembles it."""
    with c.responses.stream(
        model=MODEL, input=MESSAGES[0]["content"], tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
        temperature=0, store=False, max_output_tokens=TOKENS,
    ) as s:  # fmt: skip
        done = s.get_final_response()
    drop = {"id", "call_id"}
    return done.status or "", [{k: v for k, v in item.model_dump(exclude_none=True).items()
                                if k not in drop} for item in done.output]  # fmt: skip


def test_messages_and_responses_with_tools_resume_through_every_kind_of_cut(
    tf: tuple[str, BytesFleet],
) -> None:
    parser, f = tf
    base = f.shims["parallel"].ready
    want_message = message(base)  # uninterrupted, through Baton
    assert want_message[0] == "tool_use", want_message
    assert want_message == message(f.ref.ready)  # as the engine's own /v1/messages
    client = f.client("parallel")
    want_response = response(client)
    assert [i["name"] for i in want_response[1] if i["type"] == "function_call"] == [
        "get_weather", "get_time"], want_response  # fmt: skip
    _, ids = reference(f)
    before = len(f.admin.events(kind="failover", limit=10_000))
    tried = list(range(3, len(ids), 14))
    for n, k in enumerate(tried):
        f.settled(before + 2 * n)
        f.arm.set(k)
        assert message(base) == want_message, f"{parser}: Messages cut after {k} tokens"
        f.settled(before + 2 * n + 1)
        f.arm.set(k)
        assert response(client) == want_response, f"{parser}: Responses cut after {k} tokens"
    f.settled(before + 2 * len(tried))
    events = f.admin.events(kind="failover", limit=10_000)[before:]
    assert len(events) == 2 * len(tried)
    assert {e["outcome"] for e in events} == {"resumed"}, events


# -- Reasoning, then tool calls: both splits kept across the seam ------------------------------


@pytest.fixture(scope="module", params=["plain", "special"])
def thinking(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BytesFleet]:
    """Sims that think (deepseek_r1 tags) before their hermes calls. The tags are ordinary
    added tokens, or special ones (--think-special): vLLM's hermes parser turns
    skip_special_tokens off for a request offering tools, so their text shows in the stream
    either way, and Baton's resume asks for the same."""
    special = ("--think-special",) if request.param == "special" else ()
    flags = (*FLAGS, "--tool-call-parser", "hermes", "--reasoning", *special)
    extra = 'tool_parser = "hermes"\nreasoning_parser = "deepseek_r1"'
    tmp = tmp_path_factory.mktemp(f"thinking-{request.param}")
    with seam_fleet(tmp, flags, backend_extra=extra) as f:
        yield f


def with_reasoning(chunks: list[Any]) -> dict[str, Any]:
    out = assembled(chunks)
    out["reasoning"] = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning") or ""
                               for ch in chunks if ch.choices)  # fmt: skip
    return out


@pytest.mark.parametrize("interval", [1, 3], ids=["1tok", "merged"])
@pytest.mark.parametrize("mode", ["parallel", "inline"])
def test_reasoning_then_calls_resume_with_both_splits_kept(
    thinking: BytesFleet, mode: str, interval: int
) -> None:
    f = thinking
    kw = {"stream_interval": interval} if interval > 1 else {}
    chunks, err = read(sdk(f.ref.ready + "/v1"), extra_body={"return_token_ids": True, **kw})
    assert err is None
    ids = [t for ch in chunks if ch.choices
           for t in (ch.choices[0].model_extra or {}).get("token_ids") or []]  # fmt: skip
    want = with_reasoning(chunks)
    assert want["reasoning"] and want["finish"] == "tool_calls" and len(want["calls"]) == 2
    # The tag's text shows even where it is special (tools turn skip_special_tokens off),
    # so the engine splits merged chunks right: one token a chunk or three, one message.
    one, err = read(sdk(f.ref.ready + "/v1"))
    assert err is None and with_reasoning(one) == want
    end = f.ref_think_end()
    assert end in ids and "</think>" not in want["reasoning"] + want["content"]
    client = f.client(mode)
    think_at = ids.index(end)
    # In the reasoning, on each side of the end tag and on it, in the calls.
    tried = sorted({*range(1, len(ids), 4), think_at, think_at + 1, think_at + 2})
    before = len(f.admin.events(kind="failover", limit=10_000))
    for n, k in enumerate(tried):
        f.settled(before + n)
        f.arm.set(k)
        got, err = read(client, extra_body=kw or None)
        assert f.arm.fired.is_set()
        assert err is None, f"cut after {k}: {err!r}"
        assert with_reasoning(got) == want, f"cut after {k} tokens (the end tag is {think_at + 1})"
    f.settled(before + len(tried))
    events = f.admin.events(kind="failover", limit=10_000)[before:]
    assert len(events) == len(tried)
    assert {e["outcome"] for e in events} == {"resumed"}, events
    assert "divergent" not in {e["seam"] for e in events}
