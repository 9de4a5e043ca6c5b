"""What real engines send that the sim does not, found by the `real` suite (tests/real/):
vLLM 0.32's completion chunks carry `prompt_token_ids: null` after the first one, and a
token-id engine (vLLM) may fail over to one without ids (llama-server, text path)."""

from __future__ import annotations

import orjson

from dataplane.relay.progress import ChoiceProgress, id_array
from dataplane.relay.stitch import Stitcher
from dataplane.request import ClientRequest, Endpoint


def completion_chunk(text: str, ids: list[int], prompt_ids: list[int] | None) -> bytes:
    choice = {"index": 0, "text": text, "prompt_token_ids": prompt_ids, "token_ids": ids}
    return orjson.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})


def test_null_prompt_ids_on_later_chunks_keep_the_first_ones() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "temperature": 0}
    s = Stitcher(ClientRequest(Endpoint.COMPLETIONS, body, "m", True, True), strip_ids=True)
    s.original(completion_chunk("a", [97], [120]), b"")
    s.original(completion_chunk("b", [98], None), b"")
    p = s.choices[0]
    # Without the prompt ids the resume could not take the token path.
    assert (p.prompt_ids, p.ids()) == (id_array([120]), [97, 98])


def test_text_chunks_after_ids_count_as_generated() -> None:
    p = ChoiceProgress(0, prompt_ids=[1, 2])
    p.add("ab", [97, 98])  # first backend: ids
    p.add("c", [])  # resumed by text: no ids, one token per chunk
    p.add("d", [])
    assert p.generated == 4
    assert p.ids() == [97, 98]


def test_text_only_progress_counts_chunks() -> None:
    p = ChoiceProgress(0)
    p.add("a", [])
    p.add("", [])  # a chunk with no text is not a token
    p.add("b", [])
    assert p.generated == 2
