"""Byte-level mode: a vocabulary and model that emit multi-byte and invalid UTF-8.

Also pins the default (ASCII) mode to outputs recorded before byte-level mode
existed: existing tests and benchmarks rely on them bit for bit.
"""

from __future__ import annotations

import hashlib

from sim.generation import Sequence, TokenEvent
from sim.model import ModelConfig, ToyModel
from sim.protocol import SamplingParams
from sim.tokenizer import FIRST_MERGE_ID, build_tokenizer
from tests.factories import greedy

ASCII = build_tokenizer()
BYTES = build_tokenizer(byte_level=True)
PROMPTS = [
    "<|bos|><|user|>What does a router do?<|end|><|assistant|>",
    "<|bos|><|user|>hello<|end|><|assistant|>",
    "<|bos|><|user|>Écris en français, 中文 aussi 😀<|end|><|assistant|>",
    "<|bos|>The model routes a stream",
]


def _kinds(ids: list[int]) -> dict[str, int]:
    """Count tokens by how they sit in the UTF-8 byte stream."""
    counts = dict.fromkeys(
        ("ascii", "whole", "opens", "continues", "stray", "cut_by_ascii"), 0
    )
    owed = 0
    for t in ids:
        piece = BYTES.visible[t]
        if piece.isascii():
            counts["cut_by_ascii" if owed else "ascii"] += 1
            owed = 0
            continue
        i = 0
        if owed and 0x80 <= piece[0] <= 0xBF:
            counts["continues"] += 1
            while i < len(piece) and owed and 0x80 <= piece[i] <= 0xBF:
                i, owed = i + 1, owed - 1
            continue
        lead = piece.lstrip(b" ")[0]
        if 0x80 <= lead <= 0xBF:
            counts["stray"] += 1  # a continuation byte with nothing to continue
            owed = 0
            continue
        size = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        have = len(piece.lstrip(b" "))
        owed = size - have
        counts["opens" if owed else "whole"] += 1
    return counts


def _all_kinds(seed: int = 0) -> dict[str, int]:
    model = ToyModel(ModelConfig(seed=seed), BYTES)
    total = dict.fromkeys(_kinds([]), 0)
    for text in PROMPTS:
        for k, v in _kinds(greedy(model, BYTES.encode(text), 400)).items():
            total[k] += v
    return total


def test_greedy_output_mixes_whole_split_and_invalid_characters() -> None:
    for seed in (0, 1):
        k = _all_kinds(seed)
        n = sum(k.values())
        non_ascii = n - k["ascii"] - k["cut_by_ascii"]
        assert 0.20 <= non_ascii / n <= 0.40, k
        assert k["whole"] / n > 0.05  # whole characters in one token
        assert k["opens"] / n > 0.05 and k["continues"] / n > 0.05  # split over tokens
        # Invalid sequences: stray continuation bytes and lead bytes cut by ASCII.
        assert k["stray"] > 0 and k["cut_by_ascii"] > 0
        # Natural splits: most opened characters are completed.
        assert k["cut_by_ascii"] < 0.3 * k["opens"]


def test_text_shows_split_characters_and_replacement_chars() -> None:
    model = ToyModel(ModelConfig(seed=0), BYTES)
    ids = greedy(model, BYTES.encode(PROMPTS[0]), 300)
    text = BYTES.decode(ids)
    assert "\ufffd" in text  # invalid sequences
    # Characters that no single token holds: they were assembled from pieces.
    singles = {BYTES.texts[t] for t in ids}
    assembled = {c for c in text if not c.isascii() and c != "\ufffd" and c not in singles}
    assert len(assembled) >= 5


def test_byte_level_is_deterministic_and_resumes_from_any_prefix() -> None:
    model = ToyModel(ModelConfig(seed=0), BYTES)
    prompt = BYTES.encode(PROMPTS[2])
    full = greedy(model, prompt, 200)
    assert full == greedy(ToyModel(ModelConfig(seed=0), BYTES), prompt, 200)
    for k in (0, 1, 2, 3, 17, 60, 199):  # includes cuts inside characters
        assert greedy(model, prompt + full[:k], 200 - k) == full[k:]
    assert any(BYTES.ends_mid_character(prompt + full[:k]) for k in range(1, 60))


def test_chip_noise_still_only_flips_near_ties() -> None:
    a = ToyModel(ModelConfig(seed=0, chip_seed=1, tie_rate=0.1), BYTES)
    b = ToyModel(ModelConfig(seed=0, chip_seed=2, tie_rate=0.1), BYTES)
    prompt = BYTES.encode(PROMPTS[0])
    h, last = a.start(prompt), prompt[-1]
    ties = flips = 0
    for tok in greedy(a, prompt, 2000):
        tie = a.near_tie(h)
        ties += tie
        if b.greedy(h, last) != tok:
            assert tie
            flips += 1
        h, last = a.advance(h, tok), tok
    assert 100 < ties < 300 and 0.3 * ties < flips < 0.7 * ties
    assert greedy(ToyModel(ModelConfig(seed=0, chip_seed=9), BYTES), prompt, 300) == greedy(
        ToyModel(ModelConfig(seed=0, chip_seed=1), BYTES), prompt, 300
    )  # tie_rate 0: chips agree


def test_candidates_and_sampling_work_in_every_utf8_state() -> None:
    model = ToyModel(ModelConfig(seed=0, tie_rate=0.3, chip_seed=5), BYTES)
    prompt = BYTES.encode(PROMPTS[1])
    h, last = model.start(prompt), prompt[-1]
    for tok in greedy(model, prompt, 300):
        cands = model.candidates(h, last, k=20)
        assert cands.ids[0] == model.greedy(h, last) == tok and len(set(cands.ids)) == 20
        h, last = model.advance(h, tok), tok
    seq = Sequence(model, prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=3))
    seq.run_to_end()
    again = Sequence(model, prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=3))
    again.run_to_end()
    assert seq.token_ids == again.token_ids and len(seq.token_ids) == 200


def test_vocabulary_extends_the_ascii_one_with_its_own_hash() -> None:
    assert BYTES.vocab_hash() != ASCII.vocab_hash()
    assert BYTES.pieces[: ASCII.vocab_size] == ASCII.pieces  # ASCII merge ids unchanged
    assert len(BYTES.encode("中")) == 1 and len(BYTES.encode("😀")) == 1
    assert len(ASCII.encode("中")) == 3
    pieces = set(BYTES.pieces[FIRST_MERGE_ID:])
    assert {b"\xe4\xb8", b" \xe4", b"\xf0\x9f\x98"} <= pieces  # partial characters
    assert BYTES.texts[BYTES.pieces.index(b"\xe4\xb8")] == "\ufffd"
    for text in ("中文 café 😀 — “quoted” …", "\ufffd", "plain"):
        assert BYTES.decode(BYTES.encode(text)) == text
    assert BYTES.encode("\ufffd") == [0xEF, 0xBF, 0xBD]  # U+FFFD in text re-encodes as bytes
    assert build_tokenizer(3, byte_level=True).vocab_hash() != BYTES.vocab_hash()


def test_new_vocabularies_cut_out_special_tokens_after_punctuation() -> None:
    text = "<|bos|><|user|>Why? 中文<|end|><|assistant|>"
    assert BYTES.encode(text)[-2:] == [BYTES.added["<|end|>"], BYTES.added["<|assistant|>"]]  # type: ignore[index]
    # The default vocabulary keeps its historical pre-tokenization bit for bit.
    assert ASCII.encode("<|user|>Why?<|end|>")[-1] == ord(">")


# -- default mode is unchanged ---------------------------------------------------------
# Recorded with the sim as it was before byte-level mode and the new detokenizer.
_PROMPT = [256, 259, 87, 345, 323, 111, 273, 313, 462, 344, 323, 111, 63, 60, 124, 270, 100,
           124, 62, 60, 124, 288, 115, 278, 116, 266, 116, 124, 62]
_GREEDY_24 = [268, 411, 32, 334, 101, 464, 399, 360, 454, 468, 446, 453, 359, 262, 116, 101,
              101, 114, 105, 422, 356, 101, 101, 69]
_STOP_RELEASES = [" w", "ou", " ", "f", "tT", "es", "e", "rdp", "r", "ola", "ll wi", "ll",
                  "ch wi", "ll", " y", " ", "d", "rw "]


def test_default_mode_outputs_are_bit_for_bit_as_before() -> None:
    assert ASCII.vocab_hash() == (
        "sha256:34e38bc9790c77dc044aa16d01f4f0c425bc0b018c7bd2d5d641726c0845a74b"
    )
    assert ASCII.encode("<|bos|><|user|>What does a router do?<|end|><|assistant|>") == _PROMPT
    model = ToyModel(ModelConfig(seed=0), ASCII)
    seq = Sequence(model, _PROMPT, SamplingParams(max_tokens=24))
    seq.run_to_end()
    assert seq.token_ids == _GREEDY_24
    assert seq.output_text() == "on their ande st hermenical cacougallyprothteeri moonseeE"
    long = greedy(model, _PROMPT, 500)
    assert hashlib.sha256(repr(long).encode()).hexdigest()[:16] == "52a43efd03d9db37"
    noisy = ToyModel(ModelConfig(seed=3, eos_rate=0.02, tie_rate=0.3, chip_seed=5), ASCII)
    stepped = Sequence(noisy, _PROMPT, SamplingParams(max_tokens=60, stop=("th", "e a")))
    events: list[TokenEvent] = []
    while not stepped.finished:
        events.append(stepped.step())
    assert [e.text for e in events] == _STOP_RELEASES
    assert (stepped.finish_reason, stepped.stop_reason) == ("stop", "th")
    assert stepped.output_text() == " wou ftTeserdprolall willch will y drw "
