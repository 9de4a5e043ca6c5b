"""Text release exactly like vLLM 0.32 (tokenizers DecodeStream), stop strings on top.

The reference vectors were produced with the real tokenizers 0.23 library on a
byte vocabulary (id == byte) with the sim's special ids; None = no text released
with that token (the sim's TokenEvent.text == "").
"""

from __future__ import annotations

import pytest

from sim.generation import Detokenizer, Sequence, TokenEvent, released_text
from sim.model import ModelConfig, ToyModel
from sim.protocol import SamplingParams
from sim.tokenizer import ASSISTANT, BOS, END, EOS, USER, build_tokenizer

TOK = build_tokenizer()
BYTES = build_tokenizer(byte_level=True)
CASE = [BOS, USER, *b"Case 1: write on.", END, ASSISTANT]
GEN = [10, 156, 64, 65, 0xE4, 0xB8, 0xAD, 66]  # "\n", lone 0x9C, "@", "A", 中, "B"


def releases(prompt: list[int], gen: list[int]) -> list[str | None]:
    d = Detokenizer(TOK, prompt)
    return [d.step(t) or None for t in gen]


@pytest.mark.parametrize(
    ("cut", "want"),
    [
        (0, ["\n", None, "\ufffd@", "A", None, None, "中", "B"]),
        (1, [None, "\ufffd@", "A", None, None, "中", "B"]),
        # The prompt ends on the lone 0x9C: the first release is the whole prompt.
        (2, ["Case 1: write on.\n\ufffd@", "A", None, None, "中", "B"]),
        (4, [None, None, "中", "B"]),
        (5, [None, "Case 1: write on.\n\ufffd@A中", "B"]),  # ... ends on E4: same quirk
        (7, ["B"]),
    ],
)
def test_release_rule_matches_the_reference_vectors(cut: int, want: list[str | None]) -> None:
    assert releases(CASE + GEN[:cut], GEN[cut:]) == want


def test_prompt_quirk_vectors_for_short_prompts() -> None:
    assert releases([BOS, *b"ab", 0x80], [65, 66]) == ["ab\ufffdA", "B"]
    assert releases([BOS, *b"ab", 0x80, 65], [66]) == ["B"]  # prompt text ends clean: no quirk
    # A genuine U+FFFD (EF BF BD) at the end of the prompt is held too.
    assert releases([BOS, *b"ab", 0xEF, 0xBF, 0xBD], [65]) == ["ab\ufffdA"]


def test_special_tokens_add_no_bytes_and_do_not_cut_a_character() -> None:
    assert releases([BOS], [0xE4, EOS, 0xB8, 0xAD]) == [None, None, None, "中"]
    assert Detokenizer(TOK, [BOS, USER]).step(EOS) == ""


def test_ends_mid_character_agrees_with_a_full_decode() -> None:
    cases = [
        [BOS], [BOS, USER], [*b"abc"], [0xE4, 0xB8], [0xE4, 0xB8, 0xAD], [0xB8, 0xAD],
        [0x80, 0x80, 0x80, 0x80, 0x80], [0xF0, 0x9F, 0x98], [0xF0, 0x9F, 0x98, 0x80],
        [0xEF, 0xBF, 0xBD], [0xE4, 65], [0xE4, 0xB8, END], [65, 0xC3, 0xA9, 0xA9],
        BYTES.encode("中文 😀"), BYTES.encode("中文 😀")[:-1],
    ]
    for ids in cases:
        want = BYTES.decode(ids, skip_special_tokens=True).endswith("\ufffd")
        assert BYTES.ends_mid_character(ids) is want, ids


def _run(
    model: ToyModel, prompt: list[int], params: SamplingParams
) -> tuple[Sequence, list[TokenEvent]]:
    seq, events = Sequence(model, prompt, params), []
    while not seq.finished:
        events.append(seq.step())
    return seq, events


MODEL = ToyModel(ModelConfig(seed=0), BYTES)
PROMPT = BYTES.encode("<|bos|><|user|>Write something in 中文, please.<|end|><|assistant|>")


def _length_ending_mid_character() -> int:
    """A max_tokens at which byte-level greedy output stops inside a character."""
    full = Sequence(MODEL, PROMPT, SamplingParams(max_tokens=300))
    full.run_to_end()
    for n in range(10, 300):
        if BYTES.ends_mid_character(full.token_ids[:n]):
            return n
    raise AssertionError("no cut inside a character in 300 tokens")


def test_finish_drops_the_bytes_never_released() -> None:
    n = _length_ending_mid_character()
    seq, events = _run(MODEL, PROMPT, SamplingParams(max_tokens=n))
    streamed = "".join(e.text for e in events)
    plain = BYTES.decode(seq.token_ids, skip_special_tokens=True)
    assert plain.endswith("\ufffd") and not streamed.endswith("\ufffd")
    assert plain.startswith(streamed) and len(streamed) < len(plain)
    assert seq.output_text() == streamed  # non-streaming text = what a stream shows
    fast = Sequence(MODEL, PROMPT, SamplingParams(max_tokens=n))
    fast.run_to_end()
    assert fast.token_ids == seq.token_ids and fast.output_text() == streamed


def test_held_tokens_stream_empty_text_but_keep_their_ids() -> None:
    seq, events = _run(MODEL, PROMPT, SamplingParams(max_tokens=200))
    assert [e.token_id for e in events] == seq.token_ids
    held = [e for e in events if e.text == ""]
    assert held, "byte-level output should hold some bytes back"
    assert "".join(e.text for e in events) == seq.output_text()


def _multibyte_stop() -> tuple[str, str]:
    """A stop string ending in a non-ASCII character that the greedy output completes."""
    full = _run(MODEL, PROMPT, SamplingParams(max_tokens=300))[0].output_text()
    for i in range(40, len(full)):
        if not full[i].isascii() and full[i] != "\ufffd" and full[i - 2 : i].isascii():
            return full, full[i - 2 : i + 1]
    raise AssertionError("no multi-byte character in 300 tokens")


def test_stop_string_on_a_multibyte_character_cuts_before_it() -> None:
    full, stop = _multibyte_stop()
    seq, events = _run(MODEL, PROMPT, SamplingParams(max_tokens=300, stop=(stop,)))
    want = full[: full.find(stop)]
    assert seq.output_text() == "".join(e.text for e in events) == want
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == stop
    # The token that completed the stop string counts as generated.
    assert stop in BYTES.decode(seq.token_ids)
    assert stop not in BYTES.decode(seq.token_ids[:-1])


def test_include_stop_str_in_output_keeps_it_and_holds_nothing_back() -> None:
    full, stop = _multibyte_stop()
    params = SamplingParams(max_tokens=300, stop=(stop,), include_stop_str_in_output=True)
    seq, events = _run(MODEL, PROMPT, params)
    want = full[: full.find(stop) + len(stop)]
    assert seq.output_text() == "".join(e.text for e in events) == want
    # No hold-back: every release reaches the client with its own token.
    plain = Detokenizer(BYTES, PROMPT)
    assert [e.text for e in events] == [plain.step(t) for t in seq.token_ids]


def test_stop_strings_hold_back_partial_matches_in_characters() -> None:
    full, stop = _multibyte_stop()
    seq, events = _run(MODEL, PROMPT, SamplingParams(max_tokens=300, stop=(stop, "zzzzzz")))
    assert seq.output_text() == full[: full.find(stop)]
    # Until the end, what was sent is the released text minus max(len(stop)) - 1 = 5
    # characters (characters, not bytes: a held-back "中" is one of them).
    detok, released, sent = Detokenizer(BYTES, PROMPT), "", ""
    for e, t in zip(events[:-1], seq.token_ids, strict=False):
        released += detok.step(t)
        sent += e.text
        assert sent == released[: max(0, len(released) - 5)]


def test_released_text_replays_only_when_needed() -> None:
    assert released_text(TOK, CASE, GEN) == "\n\ufffd@A中B"
    assert released_text(TOK, CASE + GEN[:2], GEN[2:]) == "Case 1: write on.\n\ufffd@A中B"
    assert released_text(TOK, CASE, GEN[:5]) == "\n\ufffd@A"  # E4 never completed: dropped


# -- skip_special_tokens off (a request's, or a tool parser's adjust_request: sim.adjust) -----
def test_skip_special_tokens_off_releases_the_specials_text() -> None:
    assert Detokenizer(TOK, [BOS, USER], skip_special_tokens=False).step(EOS) == "<|eos|>"
    shown = Detokenizer(TOK, [BOS], skip_special_tokens=False)
    assert [shown.step(t) for t in (65, END, 66)] == ["A", "<|end|>", "B"]
    # The prompt quirk spells the prompt's specials too (measured on vLLM 0.32:
    # "<|bos|><|user|>hi<|end|><|assistant|>���d٩", docs/real-engine-bytes.md).
    primed = Detokenizer(TOK, [BOS, *b"ab", 0x80], skip_special_tokens=False)
    assert primed.primed and primed.step(65) == "<|bos|>ab\ufffdA"


def test_a_shown_special_after_a_lead_byte_ends_the_prompt_on_a_whole_character() -> None:
    ids = [BOS, 0xE4, 0xB8, END]
    assert BYTES.ends_mid_character(ids)  # the special adds no bytes: E4 B8 is open
    assert not BYTES.ends_mid_character(ids, skip_special_tokens=False)  # "...<|end|>"
    assert Detokenizer(BYTES, ids).primed
    assert not Detokenizer(BYTES, ids, skip_special_tokens=False).primed


def test_released_text_with_specials_shown() -> None:
    assert released_text(TOK, CASE, [65, END, 66], skip_special_tokens=False) == "A<|end|>B"
    assert released_text(TOK, CASE, [65, END, 66]) == "AB"
    quirk = released_text(TOK, [BOS, *b"ab", 0x80], [65], skip_special_tokens=False)
    assert quirk == "<|bos|>ab\ufffdA"


THINK = build_tokenizer(byte_level=True, reasoning=True, think_special=True)
THINK_MODEL = ToyModel(ModelConfig(seed=2, think_tokens=6, eos_rate=0.02), THINK)  # EOS at 79
THINK_PROMPT = THINK.encode("<|bos|><|user|>Why?<|end|><|assistant|><think>")


@pytest.mark.parametrize("stops", [(), ("zzz",)], ids=["plain", "with-stops"])
def test_a_special_think_tag_shows_with_skip_special_tokens_off_and_eos_never_does(
    stops: tuple[str, ...],
) -> None:
    texts = {}
    for skip in (True, False):
        params = SamplingParams(max_tokens=200, stop=stops, skip_special_tokens=skip)
        seq, events = _run(THINK_MODEL, THINK_PROMPT, params)
        assert seq.token_ids[-1] == EOS and THINK.think_end in seq.token_ids
        texts[skip] = "".join(e.text for e in events)
        assert seq.output_text() == texts[skip]  # non-streaming text = what a stream shows
    assert "</think>" not in texts[True] and texts[False].count("</think>") == 1
    assert texts[False].replace("</think>", "") == texts[True]
    assert "<|eos|>" not in texts[False]  # vLLM does not detokenize the EOS token...
    params = SamplingParams(max_tokens=200, stop=stops, skip_special_tokens=False,
                            include_stop_str_in_output=True)  # fmt: skip
    seq, events = _run(THINK_MODEL, THINK_PROMPT, params)
    assert events[-1].text.endswith("<|eos|>")  # ...unless it is to be in the output
    out = seq.output_text()
    assert out == "".join(e.text for e in events) and out.startswith(texts[False])
    # (Bytes held back before it, an unfinished character, come out with it as U+FFFD.)
    assert out[len(texts[False]) :].strip("\ufffd") == "<|eos|>"
