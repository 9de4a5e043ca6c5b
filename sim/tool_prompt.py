"""Tools in the prompt: how the template writes them, and how the model reads them back (pure).

The template (sim.chat_template, tool-call mode, tool_choice auto) opens the
prompt with a system turn that holds the tools, Qwen/Hermes style::

    <|bos|><|system|>{the request's system message, if first}

    # Tools

    You may call one or more functions to assist with the user query.
    <tools>
    {"type": "function", "function": {...}}      (one JSON line per tool)
    </tools>
    Make at most one function call.              (only with parallel_tool_calls false)<|end|>

and a tool result (role "tool") as
``<|user|><tool_response>\\n{content}\\n</tool_response><|end|>``.

The model reads those back from token ids alone (``read``): the tools from the
first system turn's text, whether the turn it writes answers a tool result
(the text before the last ``<|assistant|>`` ends with ``</tool_response>``),
and where that turn starts. So a /v1/completions request whose prompt is a
chat prompt's ids plus some generated ids is read exactly as the chat was.
"""

# baton: pure

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sim.tokenizer import Tokenizer

TOOLS_OPEN = "<tools>\n"
TOOLS_CLOSE = "\n</tools>"
RESPONSE_OPEN = "<tool_response>\n"
RESPONSE_CLOSE = "\n</tool_response>"
ONE_CALL = "\nMake at most one function call."
_HEADER = "# Tools\n\nYou may call one or more functions to assist with the user query.\n"
DEFAULT_ARG = "city"
_ASSISTANT = b"<|assistant|>"
_SYSTEM_START = b"<|bos|><|system|>"
_SYSTEM_END = "<|end|>"
_RESULT_END = (RESPONSE_CLOSE + "<|end|>").encode()


@dataclass(frozen=True, slots=True)
class ToolDef:
    """What the model uses of one tool: its name and its first two parameters."""

    name: str
    params: tuple[tuple[str, str], ...]  # (property, JSON type) in schema order


@dataclass(frozen=True, slots=True)
class PromptView:
    """What the model read from a history: where its turn starts, and how to answer."""

    turn: int  # index of the turn's first token (after the last <|assistant|>)
    tools: tuple[ToolDef, ...]  # empty: none offered
    after_result: bool  # the turn answers a tool result: plain text, then EOS
    one_call: bool  # parallel_tool_calls false


def tools_block(system: str, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """The system turn's text holding the tools (``tools`` as the request gave them)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    head = f"{system}\n\n" if system else ""
    return f"{head}{_HEADER}{TOOLS_OPEN}{lines}{TOOLS_CLOSE}{'' if parallel else ONE_CALL}"


def tool_response(content: str) -> str:
    return f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"


def read(tok: Tokenizer, ids: Sequence[int]) -> PromptView | None:
    """The model's reading of a history; None when it holds no assistant turn.

    Goes by the bytes the ids spell, not by the special ids themselves: the
    default vocabulary's pre-tokenizer spells a special that follows
    punctuation ("?<|end|>") as plain bytes.
    """
    pieces = tok.pieces
    data = b"".join(pieces[i] for i in ids)
    at = data.rfind(_ASSISTANT)
    if at < 0:
        return None
    tools: tuple[ToolDef, ...] = ()
    one = False
    if data.startswith(_SYSTEM_START):
        tools, one = _parse_block(data[:at].decode("utf-8", errors="replace"))
    after = data[:at].endswith(_RESULT_END)
    # The turn starts at the first token that starts after the assistant tag.
    end, pos, turn = at + len(_ASSISTANT), 0, len(ids)
    for i, t in enumerate(ids):
        if pos >= end:
            turn = i
            break
        pos += len(pieces[t])
    return PromptView(turn, tools, after, one)


def _parse_block(text: str) -> tuple[tuple[ToolDef, ...], bool]:
    at = text.find(TOOLS_OPEN)
    if at < 0 or text.find(_SYSTEM_END, 0, at) >= 0:
        return (), False  # no <tools> block in the first system turn
    stop = text.find(TOOLS_CLOSE, at)
    if stop < 0:
        return (), False
    out: list[ToolDef] = []
    for line in text[at + len(TOOLS_OPEN) : stop].split("\n"):
        try:
            fn = json.loads(line)["function"]
            name = fn["name"]
        except (ValueError, KeyError, TypeError):
            continue  # not a tool the model can read: it does not call it
        if isinstance(name, str):
            out.append(ToolDef(name, _params(fn.get("parameters"))))
    return tuple(out), text[stop + len(TOOLS_CLOSE) :].startswith(ONE_CALL)


def _params(schema: object) -> tuple[tuple[str, str], ...]:
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(props, Mapping) or not props:
        return ((DEFAULT_ARG, "string"),)
    out = []
    for key, spec in list(props.items())[:2]:
        kind = spec.get("type") if isinstance(spec, Mapping) else None
        out.append((str(key), kind if kind in ("integer", "number") else "string"))
    return tuple(out)
