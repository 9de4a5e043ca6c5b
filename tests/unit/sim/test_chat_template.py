from __future__ import annotations

import pytest

from sim.chat_template import Message, TemplateError, parse_messages, render
from sim.tokenizer import ASSISTANT, build_tokenizer

TOK = build_tokenizer()
MSGS = (Message("system", "Be brief."), Message("user", "Hi there"))


def test_render_wraps_messages_and_adds_generation_prompt() -> None:
    assert render(MSGS) == ("<|bos|><|system|>Be brief.<|end|><|user|>Hi there<|end|><|assistant|>")
    assert render(MSGS, add_generation_prompt=False).endswith("Hi there<|end|>")


def test_continue_final_message_leaves_the_last_message_open() -> None:
    partial = "The answer is th"
    cont = render(
        [*MSGS, Message("assistant", partial)],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert cont == render(MSGS) + partial
    ids = TOK.encode(cont)
    prefix = TOK.encode(render(MSGS))
    assert ids[: len(prefix)] == prefix and prefix[-1] == ASSISTANT
    assert ids[len(prefix) :] == TOK.encode(partial)


def test_continue_final_message_with_generation_prompt_is_rejected_like_vllm() -> None:
    with pytest.raises(TemplateError, match="Cannot set both"):
        render(MSGS, add_generation_prompt=True, continue_final_message=True)


def test_content_parts_are_joined_and_null_content_is_empty() -> None:
    msgs = parse_messages(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert msgs == (Message("user", "ab"), Message("assistant", ""))


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        "hi",
        [{"content": "no role"}],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        ["not an object"],
    ],
)
def test_bad_messages_are_rejected(raw: object) -> None:
    with pytest.raises(TemplateError):
        parse_messages(raw)
