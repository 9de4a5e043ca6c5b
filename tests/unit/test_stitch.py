from __future__ import annotations

import orjson

from dataplane.relay.progress import id_array
from dataplane.relay.resume.stops import StopMatcher
from dataplane.relay.stitch import Stitcher
from dataplane.request import Endpoint
from tests.factories import client_request


def chunk(**fields: object) -> bytes:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    return orjson.dumps({**base, **fields})


def events(out: bytes) -> list[object]:
    return [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]


def test_strips_injected_token_ids_and_tracks_progress() -> None:
    s = Stitcher(client_request(), strip_ids=True)
    role = chunk(
        choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        prompt_token_ids=[1, 2, 3],
    )
    out, failure = s.original(role, b"")
    assert failure is None and out is not None and b"prompt_token_ids" not in out
    out, _ = s.original(
        chunk(choices=[{"index": 0, "delta": {"content": "hi"}, "token_ids": [40]}]), b""
    )
    assert out is not None and b"token_ids" not in out
    p = s.choices[0]
    assert (p.prompt_ids, p.ids(), p.text) == (id_array([1, 2, 3]), [40], "hi")


def test_keeps_the_raw_bytes_when_the_client_asked_for_ids() -> None:
    s = Stitcher(client_request(return_token_ids=True), strip_ids=False)
    data = chunk(choices=[{"index": 0, "delta": {"content": "a"}, "token_ids": [5]}])
    raw = b"data: " + data + b"\n\n"
    assert s.original(data, raw) == (raw, None)


def test_failure_signals() -> None:
    s = Stitcher(client_request(), strip_ids=True)
    assert s.original(b'{"error": {"message": "engine died"}}', b"")[1] == "error_event"
    assert s.original(b"not json", b"")[1] == "garbage"
    out, failure = s.original(
        chunk(choices=[{"index": 0, "delta": {"content": "x"}, "finish_reason": "abort"}]), b""
    )
    assert failure == "finish_abort"
    assert out is not None and events(out)[0]["choices"][0]["finish_reason"] is None  # type: ignore[index]
    assert s.unfinished()[0].text == "x"


def test_resumed_chunks_look_like_the_first_stream_and_usage_is_whole() -> None:
    s = Stitcher(client_request(stream_options={"include_usage": True}), strip_ids=True)
    s.original(
        chunk(
            choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            prompt_token_ids=[1, 2, 3],
        ),
        b"",
    )
    s.original(chunk(choices=[{"index": 0, "delta": {"content": "a"}, "token_ids": [9]}]), b"")
    s.resumed = True
    s.choices[0].add("b", [10])
    (c,) = events(s.chunk(0, "b", [10], "length"))
    assert c["id"] == "chatcmpl-1" and c["created"] == 7 and c["model"] == "m"  # type: ignore[index]
    assert c["object"] == "chat.completion.chunk"  # type: ignore[index]
    assert c["choices"][0]["delta"] == {"content": "b"}  # type: ignore[index]
    assert "token_ids" not in c["choices"][0]  # type: ignore[index]
    s.choices[0].finish_reason = "length"
    end = s.ending()
    assert end.endswith(b"data: [DONE]\n\n")
    assert events(end)[0]["usage"] == {  # type: ignore[index]
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }


def test_completion_format_and_expected_choices() -> None:
    s = Stitcher(client_request(Endpoint.COMPLETIONS, prompt=["a", "b"], n=2), strip_ids=True)
    assert sorted(s.choices) == [0, 1, 2, 3]
    s.ident.id = "cmpl-1"
    (c,) = events(s.chunk(3, "zz", [], None))
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "zz"  # type: ignore[index]


def test_stop_matcher_across_the_seam() -> None:
    m = StopMatcher(["END"], include=False, pending="E")  # "E" was held back before the seam
    assert m.feed("N") == ("", None)
    assert m.feed("D and more") == ("", "END")
    m2 = StopMatcher(["xyz"], include=True)
    assert m2.feed("abxy") == ("ab", None)
    assert m2.feed("zq") == ("xyz", "xyz")
    m3 = StopMatcher(["xyz"], include=False)
    assert m3.feed("abxy") == ("ab", None)
    assert m3.flush() == "xy"


def test_the_one_step_path_sends_and_tracks_what_the_general_path_does() -> None:
    """Stitcher._plain takes most chunks of a stream in one step; with it turned off, the
    general path must give the client the same bytes and keep the same progress."""
    stream = [
        chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}],
              prompt_token_ids=[1, 2, 3]),  # fmt: skip
        *(chunk(choices=[{"index": 0, "delta": {"content": t}, "logprobs": None,
                          "finish_reason": None, "token_ids": [40 + i]}])  # fmt: skip
          for i, t in enumerate(["He", "llo", "", " wö", "rld"])),
        chunk(choices=[{"index": 0, "delta": {}, "token_ids": [50]}]),  # a skipped tag's token
        chunk(choices=[{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop",
                        "stop_reason": None, "token_ids": [51]}],
              system_fingerprint="fp"),  # fmt: skip
    ]
    outs, progress, taken = [], [], []
    for plain in (True, False):
        s = Stitcher(client_request(), strip_ids=True)
        one_step = s._plain  # noqa: SLF001

        def counted(c: object, raw: bytes, one_step: object = one_step, on: bool = plain) -> object:
            out = one_step(c, raw) if on else None  # type: ignore[operator]
            taken.append(out is not None)
            return out

        s._plain = counted  # type: ignore[method-assign,assignment]  # noqa: SLF001
        sent = [s.original(c, b"data: " + c + b"\n\n")[0] for c in stream]
        outs.append(sent)
        p = s.choices[0]
        progress.append((p.ids(), p.text, p.settled, p.finish_reason, s.ident.system_fingerprint))
    assert outs[0] == outs[1] and progress[0] == progress[1]
    assert sum(taken) == 5  # the five text chunks took the one step, in the first run only
    assert progress[0][:2] == ([40, 41, 42, 43, 44, 50, 51], "Hello wörld!")
