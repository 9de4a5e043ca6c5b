"""Tool calls across a seam, in the stitcher: what the client has of a hermes stream is
recorded from the engine's deltas, the text is rebuilt from ids at the seam, and resumed raw
chunks are shown as the tool-call deltas that continue the client's calls. The criterion is
the assembled message: content, and per call id, name and arguments."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from dataplane.exceptions import Refused
from dataplane.relay.resume.plan import plan_resume
from dataplane.relay.stitch import Stitcher
from dataplane.relay.tools.hermes import Hermes
from dataplane.request import ClientRequest, Endpoint

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
RAW = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris é",'
       ' "n": 12}}\n</tool_call><tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def new_id() -> str:
    return "chatcmpl-tool-0123456789abcdef"


def client(**extra: Any) -> ClientRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "temperature": 0, "tools": [WEATHER], **extra}  # fmt: skip
    return ClientRequest(Endpoint.CHAT, body, "m", True, True)


def stitcher(**extra: Any) -> Stitcher:
    s = Stitcher(client(**extra), strip_ids=True)
    s.follow_tools("hermes", new_id)
    return s


def engine_deltas(text: str, step: int) -> list[tuple[str, dict[str, Any]]]:
    """The chunks a hermes engine streams for `text`, `step` characters a chunk (one
    character a token): (chunk text, delta), as vLLM re-parses at every chunk."""
    parser = Hermes([WEATHER])
    sent_content = 0
    sent: list[tuple[str, str]] = []
    out = []
    for end in range(step, len(text) + step, step):
        part = text[end - step : end]
        parsed = parser.parse(text[:end], final=end >= len(text))
        delta: dict[str, Any] = {}
        if len(parsed.content) > sent_content:
            delta["content"] = parsed.content[sent_content:]
            sent_content = len(parsed.content)
        calls = []
        for i, call in enumerate(parsed.calls):
            if i >= len(sent):
                sent.append((f"chatcmpl-tool-{i:016x}", ""))
                calls.append({"index": i, "id": sent[i][0], "type": "function",
                              "function": {"name": call.name}})  # fmt: skip
            if len(call.arguments) > len(sent[i][1]):
                calls.append({"index": i, "function": {
                    "arguments": call.arguments[len(sent[i][1]):]}})  # fmt: skip
                sent[i] = (sent[i][0], call.arguments)
        if calls:
            delta["tool_calls"] = calls
        out.append((part, delta))
    return out


def chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None, **top: Any) -> bytes:
    obj = {"id": "c", "created": 1, "model": "m", **top,
           "choices": [{"index": 0, "delta": delta, "token_ids": ids, "finish_reason": finish}]}
    return orjson.dumps(obj)


def assemble(events: list[bytes]) -> dict[str, Any]:
    """What an SDK assembles from the client's chunks: content, calls, finish."""
    content, finish = "", None
    calls: dict[int, dict[str, str]] = {}
    for ev in events:
        for line in ev.split(b"\n\n"):
            if not line.startswith(b"data: {"):
                continue
            for ch in orjson.loads(line[6:])["choices"]:
                d = ch["delta"]
                content += d.get("content") or ""
                for tc in d.get("tool_calls") or ():
                    call = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                    call["id"] = tc.get("id") or call["id"]
                    call["name"] += tc.get("function", {}).get("name") or ""
                    call["arguments"] += tc.get("function", {}).get("arguments") or ""
                finish = ch.get("finish_reason") or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def uninterrupted(step: int) -> dict[str, Any]:
    s = stitcher()
    events = [s.original(chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[1]),
                         b"")[0] or b""]  # fmt: skip
    deltas = engine_deltas(RAW, step)
    for n, (part, d) in enumerate(deltas):
        finish = "tool_calls" if n == len(deltas) - 1 else None
        events.append(s.original(chunk(d, [ord(c) for c in part], finish), b"")[0] or b"")
    return assemble(events)


@pytest.mark.parametrize("step", [1, 3])
def test_every_cut_assembles_the_uninterrupted_message(step: int) -> None:
    want = uninterrupted(step)
    assert want["content"] == "Let me check. " and want["finish"] == "tool_calls"
    assert [c["name"] for c in want["calls"]] == ["get_weather", "get_time"]
    assert json.loads(want["calls"][0]["arguments"]) == {"city": 'Pa"ris é', "n": 12}
    deltas = engine_deltas(RAW, step)
    for cut in range(1, len(deltas)):
        s = stitcher()
        events = [s.original(chunk({"role": "assistant", "content": ""}, [],
                                   prompt_token_ids=[1]), b"")[0] or b""]  # fmt: skip
        for part, d in deltas[:cut]:
            events.append(s.original(chunk(d, [ord(c) for c in part]), b"")[0] or b"")
        p = s.choices[0]
        held = "".join(part for part, _ in deltas[:cut])
        assert s.tools is not None and s.tools.rebuild(p, held) is None, cut
        plan = plan_resume(client(), p, token_path=True, seam_tokens=0,
                           extra=s.resume_fields, tools=True)  # fmt: skip
        assert plan.body["skip_special_tokens"] is False  # as the engine decoded the stream
        rest = RAW[len(held) :]
        for i, c in enumerate(rest):
            finish = "stop" if i == len(rest) - 1 else None
            events.append(s.resumed_chunk(p, c, [ord(c)], finish))
        got = assemble(events)
        assert got["content"] == want["content"], cut
        assert got["finish"] == "tool_calls", cut
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
            (c["name"], c["arguments"]) for c in want["calls"]], cut  # fmt: skip
        # The ids the client had before the cut are the ones it keeps.
        for before, after in zip(assemble(events[: cut + 1])["calls"], got["calls"],
                                 strict=False):  # fmt: skip
            assert before["id"] == after["id"] != "", cut


def test_client_text_that_the_parser_does_not_read_refuses_the_resume() -> None:
    s = stitcher()
    s.original(chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[1]), b"")
    s.original(chunk({"content": "Hello"}, [1, 2, 3, 4, 5]), b"")
    p = s.choices[0]
    assert s.tools is not None
    assert "content" in (s.tools.rebuild(p, "Jello") or "")


def test_a_parser_baton_does_not_follow_is_refused_explicitly() -> None:
    s = Stitcher(client(), strip_ids=True)
    s.follow_tools("pythonic", new_id)
    p = s.choices[0]
    assert s.tools is None and "pythonic" in p.unfollowed
    with pytest.raises(Refused, match="pythonic"):
        plan_resume(client(), p, token_path=True, seam_tokens=0)
    named = Stitcher(client(), strip_ids=True)
    named.follow_tools("", new_id)
    assert "names no tool_parser" in named.choices[0].unfollowed
    assert "names no tool_parser" in Stitcher(client(), strip_ids=True).choices[0].unfollowed


def test_required_and_named_tool_choice_are_refused_as_guided_decoding() -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        s = stitcher(tool_choice=choice)
        assert s.tools is None  # the engine runs guided decoding, not the parser
        with pytest.raises(Refused, match="guided decoding"):
            plan_resume(client(tool_choice=choice), s.choices[0], token_path=True,
                        seam_tokens=0)  # fmt: skip


def test_a_strict_tool_is_refused_as_guided_decoding() -> None:
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    s = stitcher(tools=[strict])
    with pytest.raises(Refused, match="strict tool"):
        plan_resume(client(tools=[strict]), s.choices[0], token_path=True, seam_tokens=0)
    lax = {**WEATHER, "function": {**WEATHER["function"], "strict": False}}
    plan_resume(client(tools=[lax]), stitcher(tools=[lax]).choices[0], token_path=True,
                seam_tokens=0)  # fmt: skip


def test_a_tools_stream_is_not_resumed_as_text() -> None:
    s = stitcher()
    with pytest.raises(Refused, match="token ids"):
        plan_resume(client(), s.choices[0], token_path=False, seam_tokens=0, tools=True)


def test_parallel_tool_calls_false_continues_only_the_first_call() -> None:
    s = stitcher(parallel_tool_calls=False)
    s.original(chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[1]), b"")
    p = s.choices[0]
    assert s.tools is not None and s.tools.rebuild(p, "") is None
    events = [s.resumed_chunk(p, RAW, [1], "stop")]
    got = assemble(events)
    assert [c["name"] for c in got["calls"]] == ["get_weather"]
