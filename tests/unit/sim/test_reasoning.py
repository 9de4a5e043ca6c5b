"""Reasoning mode: <think>/</think> tokens, the template, the model, vLLM's deepseek_r1 parser."""

from __future__ import annotations

import pytest

from sim.chat_template import Message, render
from sim.generation import Sequence
from sim.model import ModelConfig, ToyModel
from sim.protocol import Limits, SamplingParams, parse_chat, parse_completion
from sim.reasoning import R1Stream, extract
from sim.responses import ChoiceResult, Meta, full_response
from sim.tokenizer import ASSISTANT, THINK_END, THINK_START, Tokenizer, build_tokenizer

TOK = build_tokenizer(reasoning=True)
BYTES = build_tokenizer(byte_level=True, reasoning=True)
START, END = TOK.encode(THINK_START + THINK_END)
MSGS = (Message("user", "Why is the sky blue?"),)
LIMITS = Limits(model="toy", max_model_len=4096, default_max_tokens=64, default_temperature=0.0)


def prompt(tok: Tokenizer = TOK) -> list[int]:
    return tok.encode(render(MSGS, open_think=True))


def test_think_tokens_are_added_tokens_that_decoding_keeps() -> None:
    assert (START, END) == (TOK.merge_end, TOK.merge_end + 1)
    assert TOK.encode("a<think>b</think>c") == [97, START, 98, END, 99]
    assert TOK.decode([START, 98, END], skip_special_tokens=True) == "<think>b</think>"
    assert TOK.vocab_hash() != build_tokenizer().vocab_hash()
    others = {TOK.vocab_hash(), build_tokenizer(byte_level=True).vocab_hash()}
    assert BYTES.vocab_hash() not in others
    assert build_tokenizer().encode("<think>") != [START]  # plain vocab: just text


def test_template_opens_the_assistant_turn_with_think() -> None:
    text = render(MSGS, open_think=True)
    assert text.endswith("<|assistant|><think>")
    assert prompt()[-2:] == [ASSISTANT, START]
    cont = render([*MSGS, Message("assistant", "so")], add_generation_prompt=False,
                  continue_final_message=True, open_think=True)
    assert cont.endswith("<|assistant|>so")  # the partial is continued as given
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, TOK, LIMITS)
    assert req.prompt_ids[-1] == START and req.include_reasoning
    off = parse_chat({"messages": [{"role": "user", "content": "hi"}],
                      "include_reasoning": False}, TOK, LIMITS)
    assert not off.include_reasoning


def _generate(model: ToyModel, ids: list[int], n: int) -> list[int]:
    seq = Sequence(model, ids, SamplingParams(max_tokens=n))
    seq.run_to_end()
    return seq.token_ids


@pytest.mark.parametrize("think_tokens", [0, 5, 32, 100])
def test_model_ends_thinking_once_at_or_after_think_tokens(think_tokens: int) -> None:
    for seed in range(5):
        model = ToyModel(ModelConfig(seed=seed, think_tokens=think_tokens), TOK)
        out = _generate(model, prompt(), think_tokens + 200)
        assert out.count(END) == 1 and START not in out
        assert out.index(END) >= think_tokens  # tokens of thinking before it
        assert out.index(END) < think_tokens + 60  # and not much later


def test_no_think_block_no_end_token_and_resume_across_the_end() -> None:
    model = ToyModel(ModelConfig(seed=0, think_tokens=10), TOK)
    plain = TOK.encode(render(MSGS))  # no <think> opened
    assert END not in _generate(model, plain, 300)
    full = _generate(model, prompt(), 120)
    j = full.index(END)
    for k in (0, 1, j - 1, j, j + 1, 100):
        assert _generate(model, prompt() + full[:k], 120 - k) == full[k:]


def test_byte_level_reasoning_ends_thinking_on_a_whole_character() -> None:
    for seed in range(10):
        model = ToyModel(ModelConfig(seed=seed, think_tokens=20), BYTES)
        out = _generate(model, prompt(BYTES), 300)
        j = out.index(BYTES.encode(THINK_END)[0])
        before = BYTES.decode(out[:j], skip_special_tokens=True)
        assert not before.endswith("\ufffd")  # nothing held back when </think> comes


# -- the parser --------------------------------------------------------------------------
def stream(deltas: list[tuple[str, list[int]]], **kw: bool) -> list[dict[str, object] | None]:
    p = R1Stream(START, END, **kw)
    return [p.delta(text, ids) for text, ids in deltas]


def test_stream_reasoning_then_end_token_skipped_then_content() -> None:
    got = stream([("Hm", [1]), ("", [2]), (THINK_END, [END]), ("\n\nOK", [3]), ("", [4])])
    assert got == [
        {"reasoning": "Hm"}, {"reasoning": ""}, None, {"content": "\n\nOK"}, {"content": ""},
    ]


def test_stream_delta_with_end_token_among_others_is_split() -> None:
    assert stream([("a", [1]), ("b</think>c", [2, END, 3])]) == [
        {"reasoning": "a"}, {"reasoning": "b", "content": "c"},
    ]
    assert stream([("b</think>", [2, END])]) == [{"reasoning": "b", "content": None}]
    # The model opening its own <think> uses the base class's rules.
    assert stream([("<think>x", [START, 1]), ("y", [2]), ("</think>z", [END, 3])]) == [
        {"reasoning": "<think>x"}, {"reasoning": "y"}, {"reasoning": "", "content": "z"},
    ]
    assert stream([("<think>x</think>y", [START, 1, END, 2])]) == [
        {"reasoning": "x", "content": "y"},
    ]


def test_include_reasoning_false_drops_reasoning_deltas() -> None:
    got = stream([("Hm", [1]), ("", [2]), ("b</think>c", [2, END, 3]), ("d", [4])],
                 include_reasoning=False)
    # Like vLLM: a falsy reasoning ("") is left alone; a split keeps its content.
    assert got == [None, {"reasoning": ""}, {"reasoning": None, "content": "c"}, {"content": "d"}]


def test_extract_splits_non_streaming_text() -> None:
    assert extract("abc</think>def") == ("abc", "def")
    assert extract("abc") == ("abc", None)
    assert extract("abc</think>") == ("abc", None)
    assert extract("x<think>abc</think>d</think>e") == ("abc", "d</think>e")


def test_full_response_has_reasoning_and_content_on_chat_only() -> None:
    meta = Meta("id", 0, "toy", "fp", chat=True, return_token_ids=False, include_usage=False,
                reasoning=True)
    body = full_response(meta, [1], [ChoiceResult("think</think>answer", [2, END, 3], "stop")])
    msg = body["choices"][0]["message"]
    assert (msg["reasoning"], msg["content"]) == ("think", "answer")
    hidden = Meta("id", 0, "toy", "fp", chat=True, return_token_ids=False, include_usage=False,
                  reasoning=True, include_reasoning=False)
    body = full_response(hidden, [1], [ChoiceResult("think</think>answer", [2, END, 3], "stop")])
    assert body["choices"][0]["message"]["reasoning"] is None
    plain = Meta("id", 0, "toy", "fp", chat=False, return_token_ids=False, include_usage=False)
    body = full_response(plain, [1], [ChoiceResult("think</think>answer", [2, END, 3], "stop")])
    assert body["choices"][0]["text"] == "think</think>answer"
    req = parse_completion({"prompt": "x<think>", "max_tokens": 3}, TOK, LIMITS)
    assert req.prompt_ids[-1] == START and THINK_START == "<think>"
