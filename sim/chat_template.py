"""Chat template of the toy model (pure).

``<|bos|>`` then ``<|role|>content<|end|>`` per message, then ``<|assistant|>``
when add_generation_prompt. With continue_final_message the final message is
left open (no ``<|end|>``), so

    render(msgs + [partial], continue_final_message=True)
        == render(msgs, add_generation_prompt=True) + partial.text

The partial's ids then come from re-encoding its text — the text resume path,
which may tokenize differently from what the model generated (intended).

A reasoning model's template (``open_think``, DeepSeek-R1 style) opens the
assistant turn with ``<think>``: the generation prompt ends
``<|assistant|><think>``. Messages are rendered as given (an assistant
message's content is not wrapped), so continue_final_message leaves no
``<think>`` before the partial.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sim.tool_prompt import tool_response, tools_block

# vLLM accepts these roles; the toy template folds the minor ones onto three.
_ROLE_TAGS = {
    "system": "<|system|>",
    "developer": "<|system|>",
    "user": "<|user|>",
    "tool": "<|user|>",
    "assistant": "<|assistant|>",
}


class TemplateError(ValueError):
    """The messages cannot be rendered (a 400 for the client)."""


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


def parse_messages(raw: object) -> tuple[Message, ...]:
    """Validate OpenAI-shaped messages; content may be a string, null or text parts."""
    if not isinstance(raw, list) or not raw:
        raise TemplateError("'messages' must be a non-empty list")
    out: list[Message] = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise TemplateError(f"messages[{i}] must be an object")
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLE_TAGS:
            raise TemplateError(f"messages[{i}].role must be one of {sorted(_ROLE_TAGS)}")
        out.append(Message(role, _content_text(item.get("content"), i)))
    return tuple(out)


def _content_text(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise TemplateError(
                    f"messages[{i}].content parts must be {{'type':'text','text':...}}"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise TemplateError(f"messages[{i}].content must be a string or a list of text parts")


def render(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    open_think: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    parallel_tool_calls: bool = True,
) -> str:
    """Render to prompt text (special tokens as their strings).

    ``tools`` (tool-call mode, tool_choice auto): a first system turn holds
    them and tool results are wrapped in ``<tool_response>`` (sim.tool_prompt),
    so the model can read both back from the ids.
    """
    if add_generation_prompt and continue_final_message:
        # Same rule and wording as vLLM's request validator.
        raise TemplateError(
            "Cannot set both continue_final_message and add_generation_prompt to True."
        )
    pieces = ["<|bos|>"]
    if tools:
        system = messages[0].content if messages and messages[0].role == "system" else ""
        if system:
            messages = messages[1:]
        pieces.append(f"<|system|>{tools_block(system, tools, parallel_tool_calls)}<|end|>")
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        pieces.append(_ROLE_TAGS[msg.role])
        wrap = tools and msg.role == "tool"
        pieces.append(tool_response(msg.content) if wrap else msg.content)
        if not (continue_final_message and i == last):
            pieces.append("<|end|>")
    if add_generation_prompt:
        pieces.append("<|assistant|><think>" if open_think else "<|assistant|>")
    return "".join(pieces)
