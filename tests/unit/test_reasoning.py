"""Reasoning across a seam: the first stream's parsed deltas are tracked as the engine's raw
text (tag included), and a resumed raw stream is split the way vLLM's deepseek_r1 parser
splits it, by the end tag's token id."""

from __future__ import annotations

import copy
from typing import Any

import orjson

from baton.model import Seam
from dataplane.relay.resume.plan import plan_resume
from dataplane.relay.resume.reasoning import Markers, open_after, split
from dataplane.relay.resume.seam import judge_fields
from dataplane.relay.stitch import Stitcher
from dataplane.relay.thinking import CutText
from dataplane.request import ClientRequest, Endpoint
from tests.factories import client_request

START, END = 300, 301
M = Markers(START, END, "<think>", "</think>")
SPECIAL = Markers(START, END, "<think>", "</think>", special=True)
PROMPT = [1, 2, START]  # the template opened the assistant turn with <think>


def new_id() -> str:
    return "chatcmpl-tool-0123456789abcdef"


def first(s: Stitcher, delta: dict[str, object], ids: list[int], **top: object) -> None:
    obj = {"id": "c", "created": 1, "model": "m", **top}
    obj["choices"] = [{"index": 0, "delta": delta, "token_ids": ids}]
    out, failure = s.original(orjson.dumps(obj), b"")
    # A parser's empty delta is tracked but not sent: the engine sends it only for the ids.
    assert failure is None and (out is None) == (delta == {})


def delta(out: bytes) -> dict[str, object]:
    return orjson.loads(out[6:].split(b"\n\n")[0])["choices"][0]["delta"]  # type: ignore[no-any-return]


def stitcher() -> Stitcher:
    s = Stitcher(client_request(), strip_ids=True)
    s.follow_reasoning("deepseek_r1", M)
    first(s, {"role": "assistant", "content": ""}, [], prompt_token_ids=PROMPT)
    return s


def test_open_after_reads_the_prompts_last_tag() -> None:
    assert open_after([1, START], M) and open_after([1, 2], M)
    assert not open_after([1, START, 5, END, 6], M)
    assert split("ab</think>cd", M) == ("ab", "cd") and split("ab", M) is None


def test_first_stream_is_tracked_as_raw_text_with_the_tag() -> None:
    s = stitcher()
    p = s.choices[0]
    assert p.reasoning
    first(s, {"reasoning": "hm"}, [10])
    first(s, {}, [END])  # vLLM sends the tag's token alone with an empty delta
    first(s, {"content": "yes"}, [11])
    assert p.text == "hm</think>yes" and p.reply == "yes" and not p.reasoning
    assert p.reasoning_field == "reasoning" and p.ids() == [10, END, 11]


def test_a_delta_holding_the_tag_is_split_like_the_parser_does() -> None:
    s = stitcher()
    first(s, {"reasoning": "a", "content": "b"}, [10, END, 11])
    p = s.choices[0]
    assert p.text == "a</think>b" and p.reply == "b" and not p.reasoning


def test_resumed_raw_text_keeps_reasoning_then_content() -> None:
    s = stitcher()
    first(s, {"reasoning_content": "so"}, [10])  # an older engine's field name
    p = s.choices[0]
    outs = []
    for raw, ids in (("me", [12]), ("</think>", [END]), ("ok", [13])):
        p.add(raw, ids)
        outs.append(s.chunk(0, raw, ids))
    assert delta(outs[0]) == {"reasoning_content": "me"}
    assert outs[1] == b""  # the tag alone: no delta, as from the parser
    assert delta(outs[2]) == {"content": "ok"} and p.reply == "ok"
    # In one chunk, and with the tag's text arriving after its token (held bytes before it).
    s2 = stitcher()
    q = s2.choices[0]
    q.add("", [0xE4, END])
    assert s2.chunk(0, "", [0xE4, END]) == b""
    q.add("\ufffd</think>x", [7])
    assert delta(s2.chunk(0, "\ufffd</think>x", [7])) == {"reasoning": "\ufffd", "content": "x"}


def test_reasoning_from_a_parser_baton_cannot_follow_is_refused_not_relabelled() -> None:
    s = Stitcher(client_request(), strip_ids=True)
    s.follow_reasoning("gpt_oss", None)
    first(s, {"role": "assistant", "content": ""}, [], prompt_token_ids=PROMPT)
    first(s, {"reasoning": "x"}, [10])
    p = s.choices[0]
    try:
        plan_resume(client_request(), p, token_path=True, seam_tokens=0)
    except Exception as why:  # noqa: BLE001 - asserting on the message
        assert "gpt_oss" in str(why)
    else:
        raise AssertionError("a resume of an unfollowed parser's stream was planned")
    unnamed = Stitcher(client_request(), strip_ids=True)
    first(unnamed, {"role": "assistant", "content": ""}, [], prompt_token_ids=PROMPT)
    first(unnamed, {"reasoning": "x"}, [10])
    assert "no reasoning_parser" in unnamed.choices[0].unfollowed


def test_tools_offered_to_a_backend_naming_no_tool_parser_refuse_a_resume() -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}  # fmt: skip
    s = Stitcher(ClientRequest(Endpoint.CHAT, body, "m", True, True), strip_ids=True)
    s.follow_tools("", new_id)
    first(s, {"role": "assistant", "content": ""}, [], prompt_token_ids=PROMPT)
    try:
        plan_resume(ClientRequest(Endpoint.CHAT, body, "m", True, True), s.choices[0],
                    token_path=True, seam_tokens=0)  # fmt: skip
    except Exception as why:  # noqa: BLE001
        assert "tool" in str(why)
    else:
        raise AssertionError("tools resumed")
    none = ClientRequest(Endpoint.CHAT, {**body, "tool_choice": "none"}, "m", True, True)
    plain = Stitcher(none, strip_ids=True)  # no parser runs: a plain stream
    first(plain, {"role": "assistant", "content": ""}, [], prompt_token_ids=PROMPT)
    plan_resume(none, plain.choices[0], token_path=True, seam_tokens=0)


def special_stitcher(**body: object) -> Stitcher:
    client = client_request()
    client.body.update(body)
    s = Stitcher(client, strip_ids=True)
    s.follow_reasoning("deepseek_r1", SPECIAL)
    first(s, {"role": "assistant", "content": ""}, [], prompt_token_ids=PROMPT)
    return s


def test_a_special_tag_shows_no_text_unless_the_client_keeps_special_tokens() -> None:
    shown = SPECIAL.shown({})
    assert (shown.start_text, shown.end_text) == ("", "") and shown.skipped == {START, END}
    kept = SPECIAL.shown({"skip_special_tokens": False})
    assert kept.end_text == "</think>" and not kept.skipped
    assert M.shown({}) == M and not M.shown({}).skipped  # an ordinary added token: kept


def test_first_stream_with_a_special_tag_is_tracked_without_its_text() -> None:
    s = special_stitcher()
    p = s.choices[0]
    first(s, {"reasoning": "hm"}, [10])
    first(s, {}, [END])  # the tag alone: an empty delta
    first(s, {"content": "yes"}, [11])
    # The raw text is what /v1/completions streams: no tag text (skip_special_tokens).
    assert p.text == "hmyes" and p.reply == "yes" and not p.reasoning


def merged(s: Stitcher, delta: dict[str, object], ids: list[int], cut: CutText | None) -> Any:
    """A first-stream chunk holding the skipped tag among other tokens: held until Baton has
    the texts it asks for (TagCut), then sent split by ids. The sent delta, or None."""
    obj = orjson.dumps({"id": "c", "created": 1, "model": "m",
                        "choices": [{"index": 0, "delta": delta, "token_ids": ids}]})  # fmt: skip
    out, failure = s.original(obj, b"")
    assert out is None and failure is None and len(s.wants) == 1
    want = s.wants[0]
    out, failure = s.original(obj, b"", {want.index: cut} if cut is not None else {})
    assert failure is None and not s.wants
    return None if out is None else delta_of(out)


def delta_of(out: bytes) -> dict[str, object]:
    return orjson.loads(out[6:].split(b"\n\n")[0])["choices"][0]["delta"]  # type: ignore[no-any-return]


def test_vllms_split_of_a_merged_chunk_with_a_skipped_tag_is_redone_by_ids() -> None:
    # vLLM cuts at text.find("</think>") == -1: reasoning = text[:-1], content = text[7:]:
    # "abcdefghi" as reasoning and "hij" as content, where the ids say "abcde" | "fghij".
    text = "abcdefghij"
    s = special_stitcher()
    first(s, {"reasoning": "xy"}, [9])
    sent = merged(s, {"reasoning": text[:-1], "content": text[7:]}, [10, 11, END, 12, 13],
                  CutText("xy", "xyabcde", None))  # fmt: skip
    assert s.wants == [] and sent == {"reasoning": "abcde", "content": "fghij"}
    p = s.choices[0]
    assert p.text == "xy" + text and p.reply == "fghij" and not p.reasoning and not p.unfollowed
    assert p.by_ids() == ("xyabcde", "fghij") and p.fields_agree()
    # "abcd" shorter than the tag: vLLM sends reasoning "abc" and no content, the "d" never
    # reaches the client; Baton decodes the ids after the tag for it.
    short = special_stitcher()
    assert merged(short, {"reasoning": "abc"}, [10, END, 12], CutText("", "ab", "cd")) == {
        "reasoning": "ab", "content": "cd"}  # fmt: skip
    first(short, {"content": "e"}, [13])
    q = short.choices[0]
    assert q.text == "abcde" and q.reply == "cde" and q.fields_agree()
    # One character before the tag: vLLM sends nothing at all for the chunk (measured on
    # vLLM 0.32: [52, 264], text "4", came as an empty delta); Baton sends it as reasoning.
    one = special_stitcher()
    assert merged(one, {}, [14, END], CutText("", "4", "")) == {"reasoning": "4"}
    first(one, {"content": "x"}, [15])
    r = one.choices[0]
    assert r.text == "4x" and r.reply == "x" and r.by_ids() == ("4", "x") and r.fields_agree()


def test_a_merged_tag_chunk_whose_ids_do_not_lead_to_its_text_is_relayed_and_not_resumed() -> None:
    s = special_stitcher()
    got = merged(s, {"reasoning": "abcdefghi", "content": "hij"}, [10, 11, END, 12, 13],
                 CutText("", "zzz", None))  # fmt: skip
    p = s.choices[0]
    assert got == {"reasoning": "abcdefghi", "content": "hij"}  # the engine's, as it came
    assert "end of thinking" in p.unfollowed and not p.fields_agree()
    # No texts for the choice at all: the same.
    t = special_stitcher()
    assert merged(t, {"reasoning": "ab"}, [10, END, 12], None) == {"reasoning": "ab"}
    assert t.choices[0].unfollowed


def test_resumed_raw_text_with_a_skipped_tag_is_cut_where_the_ids_say() -> None:
    s = special_stitcher()
    first(s, {"reasoning": "so"}, [10])
    p = s.choices[0]
    # One token a chunk: the tag alone carries no text and ends the reasoning.
    outs = []
    for raw, ids in (("me", [12]), ("", [END]), ("ok", [13])):
        assert s.thinking.needs_cut(p, ids, raw) is None
        outs.append(s.resumed_chunk(p, raw, ids))
    assert delta(outs[0]) == {"reasoning": "me"} and outs[1] == b""
    assert delta(outs[2]) == {"content": "ok"} and p.reply == "ok"
    # Merged: the caller finds the cut from the ids before the tag.
    s2 = special_stitcher()
    q = s2.choices[0]
    first(s2, {"reasoning": "so"}, [10])
    assert s2.thinking.needs_cut(q, [12, END, 13], "meok") == 2  # the tag is generated token 2
    out = s2.resumed_chunk(q, "meok", [12, END, 13], cut=2)
    assert delta(out) == {"reasoning": "me", "content": "ok"} and q.reply == "ok"
    # The tag first or last in its chunk needs no cut: its side is known.
    s3 = special_stitcher()
    r = s3.choices[0]
    assert s3.thinking.needs_cut(r, [END, 13], "ok") == 0
    assert delta(s3.resumed_chunk(r, "ok", [END, 13], cut=0)) == {"content": "ok"}
    # A tag whose token came while the text was held back: the text that follows is cut.
    s4 = special_stitcher()
    t = s4.choices[0]
    assert s4.resumed_chunk(t, "", [0xE4, END]) == b""
    assert t.reasoning and t.end_pending and s4.thinking.needs_cut(t, [14], "\ufffdx") == 1
    assert delta(s4.resumed_chunk(t, "\ufffdx", [14], cut=1)) == {
        "reasoning": "\ufffd", "content": "x",
    }  # fmt: skip


def test_the_seam_verdict_judges_the_fields_the_client_assembled() -> None:
    """Ids and overlap text can match while the client was given the wrong fields: the
    verdict compares what the client assembled, per field, with the split by ids."""
    s = stitcher()
    for d, ids in (({"reasoning": "hm"}, [10]), ({}, [END]), ({"content": "yes"}, [11]),
                   ({"content": " no"}, [12])):  # fmt: skip
        first(s, d, ids)
    p = s.choices[0]
    assert p.by_ids() == ("hm", "yes no") and p.fields_agree()
    assert judge_fields(Seam.VERIFIED, True, p.fields_agree()) is Seam.VERIFIED
    # A side check's verdict still to come:
    assert judge_fields(None, True, p.fields_agree()) is None
    # The overlap (" no") sent again after the seam: repeated content.
    repeated = copy.deepcopy(p)
    repeated.said_content.add(" no")
    assert not repeated.fields_agree()
    assert judge_fields(Seam.VERIFIED, True, repeated.fields_agree()) is Seam.DIVERGENT
    # The overlap relabelled: the client has it as reasoning, the ids say content.
    relabelled = stitcher()
    for d, ids in (({"reasoning": "hm"}, [10]), ({}, [END]), ({"content": "yes"}, [11]),
                   ({"reasoning": " no"}, [12])):  # fmt: skip
        first(relabelled, d, ids)
    q = relabelled.choices[0]
    assert q.by_ids() == ("hm", "yes no") and not q.fields_agree()
    assert judge_fields(Seam.VERIFIED, True, q.fields_agree()) is Seam.DIVERGENT
    # Wrong before the seam already (the resume itself was right): still not verified.
    assert judge_fields(Seam.VERIFIED, False, p) is Seam.DIVERGENT
    assert judge_fields(Seam.UNCHECKED, False, p) is Seam.DIVERGENT
