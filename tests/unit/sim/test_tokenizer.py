from __future__ import annotations

import pytest

from sim.model import ModelConfig, ToyModel
from sim.tokenizer import ASSISTANT, BOS, END, EOS, FIRST_MERGE_ID, USER, build_tokenizer

TOK = build_tokenizer()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello",
        "The router streams tokens from the fleet, and the cache is warm.",
        "  leading and trailing spaces  \n\ttabs\n",
        "unicode: wörld ☃ 日本語 🎉",
        "digits 1234567890 and punctuation!?;:'\"()[]{}",
    ],
)
def test_encode_decode_round_trips_text(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


def test_byte_and_special_ids_are_fixed() -> None:
    assert TOK.encode("A") == [65]
    assert TOK.encode("<|bos|><|user|>hi<|end|><|assistant|>")[:2] == [BOS, USER]
    assert TOK.encode("<|end|><|assistant|>") == [END, ASSISTANT]
    assert (BOS, EOS, END) == (256, 257, 261)
    assert TOK.vocab_size > FIRST_MERGE_ID + 150


def test_merges_apply_so_common_words_are_single_tokens() -> None:
    assert TOK.encode("th") == [FIRST_MERGE_ID]
    assert len(TOK.encode(" the")) == 1
    assert len(TOK.encode("the")) == 1
    assert len(TOK.encode("nothing")) < len("nothing")


def test_decode_skips_special_tokens_on_request() -> None:
    ids = [BOS, *TOK.encode("hi"), EOS]
    assert TOK.decode(ids) == "<|bos|>hi<|eos|>"
    assert TOK.decode(ids, skip_special_tokens=True) == "hi"


def test_partial_utf8_decodes_with_replacement() -> None:
    ids = TOK.encode("é")
    assert len(ids) == 2
    assert TOK.decode(ids[:1]) == "\ufffd"


def test_model_output_does_not_survive_retokenization() -> None:
    """Why resume must use token ids: decode->encode changes the boundaries."""
    model = ToyModel(ModelConfig(seed=0), TOK)
    prompt = TOK.encode("<|bos|><|user|>Tell me about routers<|end|><|assistant|>")
    h, last, out = model.start(prompt), prompt[-1], []
    for _ in range(64):
        nxt = model.greedy(h, last)
        out.append(nxt)
        h, last = model.advance(h, nxt), nxt
    text = TOK.decode(out)
    assert text.isascii() and text.strip()
    assert TOK.decode(TOK.encode(text)) == text  # same text ...
    assert TOK.encode(text) != out  # ... different tokens


def test_single_letters_re_encode_as_a_merge() -> None:
    emitted = [ord("t"), ord("h")]  # what a model may emit
    assert TOK.encode(TOK.decode(emitted)) == [FIRST_MERGE_ID]


def test_valid_ids_rejects_out_of_range_and_non_ints() -> None:
    assert TOK.valid_ids([0, 1, TOK.vocab_size - 1])
    assert not TOK.valid_ids([TOK.vocab_size])
    assert not TOK.valid_ids([-1])
    assert not TOK.valid_ids([True])
    assert not TOK.valid_ids(["1"])


def test_vocab_hash_is_stable_and_variants_change_it() -> None:
    assert TOK.vocab_hash() == build_tokenizer().vocab_hash()
    assert TOK.vocab_hash().startswith("sha256:") and len(TOK.vocab_hash()) == 7 + 64
    hashes = {build_tokenizer(v).vocab_hash() for v in range(16)}
    assert len(hashes) == 16  # every variant 0..15 is its own vocabulary


def test_a_variant_still_round_trips_text_but_tokenizes_differently() -> None:
    other = build_tokenizer(1)
    text = "The router streams tokens from the fleet, and the cache is warm."
    assert other.decode(other.encode(text)) == text
    assert other.encode(text) != TOK.encode(text)
    assert other.encode("<|bos|>") == [BOS]  # specials keep their ids
