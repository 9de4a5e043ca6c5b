"""The model's tool calls: a function of the token ids alone (pure).

In tool-call mode the model reads its history (sim.tool_prompt.read): the
tools the prompt offers, whether its turn answers a tool result, and how far
into its turn it is. From that and the history hash it decides, token by
token, whether it is forced to a token:

* tools offered, no call yet in this turn: once ``after`` tokens of the turn
  are out (``--tool-call-after``; 0 for llama3_json, whose parser only finds
  a call that opens the answer) and the text so far ends on a whole
  character outside a think block (``ToyModel.answer_boundary``), the model
  writes a whole script: the calls, then EOS. The script is a function of
  the tools and of the history hash where it starts, so a resume that holds
  part of it (the start token is among the ids) carries on with the rest.
* the turn answers a tool result (the last message had role "tool"): no
  call; at the same place EOS comes instead (after at least one token, in
  every format), so an agent loop ends.

The calls: the first min(``--parallel-tool-calls``, tools offered) tools in
order (one when the prompt says parallel_tool_calls false); each call fills
its tool's first two parameters (sim.tool_prompt). A string value is
letters, "é" as two byte tokens, letters, a double quote (``\\"`` in JSON),
letters; an integer or number is 2 to 4 digits, one token each. Values come
from hashes of the history, so every replica writes the same call. Formats
(``--tool-call-parser``), for one call and for several:

* hermes: ``<tool_call>\\n{"name": "f", "arguments": {"city": "Ab\\u00e9c\\"d"}}\\n</tool_call>``,
  calls joined by "\\n".
* llama3_json: ``<|python_tag|>{"name": "f", "parameters": {"city": "..."}}``,
  calls joined by "; ".
* mistral (vLLM's pre-v11 format: a Hugging Face tokenizer without ``[ARGS]``):
  ``[TOOL_CALLS][{"name": "f", "arguments": {"city": "..."}}, {...}]``.
* qwen3_xml: ``<tool_call>\\n<function=f>\\n<parameter=city>\\nAbéc"d\\n</parameter>\\n``
  ``</function>\\n</tool_call>``, calls joined by "\\n".

The script overrides sampling, draft swaps and loops (a model sure of its
call); EOS is skipped where the request forbids it (min_tokens, ignore_eos)
and the model's own text follows.
"""

# baton: pure

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sim.tokenizer import EOS, Tokenizer
from sim.tool_prompt import ToolDef, read

if TYPE_CHECKING:
    from sim.model import ToyModel

FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_xml")
_SALT = -29
_E_ACUTE = (0xC3, 0xA9)  # "é" as two byte tokens: a cut can fall inside the character


def start_token(tok: Tokenizer, fmt: str) -> int | None:
    """The id that opens a call in this format (None: the vocabulary has no tool tags)."""
    if fmt == "llama3_json":
        return tok.python_tag
    if fmt == "mistral":
        return tok.tool_calls_tag
    return tok.tool_call_start


class ToolCallPlan:
    """Per sequence: the token the model is made to emit next, if any. Mutable."""

    __slots__ = ("_model", "_fmt", "_tools", "_one", "_answer", "_after", "_pos", "_script",
                 "_at")  # fmt: skip

    def __init__(self, model: ToyModel, prompt_ids: Sequence[int]) -> None:
        tok = model.tokenizer
        cfg = model.config
        self._model = model
        self._fmt = cfg.tool_format
        view = read(tok, prompt_ids)
        self._tools: tuple[ToolDef, ...] = view.tools if view else ()
        self._one = view.one_call if view else False
        self._answer = view.after_result if view else False  # answer a tool result: EOS
        # A plain answer (to a tool result) has at least one token, in every format.
        self._after = max(1, cfg.tool_call_after) if self._answer else (
            0 if self._fmt == "llama3_json" else cfg.tool_call_after
        )
        self._script: list[int] | None = None
        self._at = 0
        turn = list(prompt_ids[view.turn :]) if view else []
        skip = 1 if turn and turn[0] == tok.think_start else 0  # the template's <think>
        self._pos = len(turn) - skip  # tokens of the turn so far
        begin = start_token(tok, self._fmt)
        if self._tools and begin in turn:  # a resume inside (or after) the script
            s = len(prompt_ids) - len(turn) + turn.index(begin)
            self._script = self._build(model.start(prompt_ids[:s]))
            self._at = len(prompt_ids) - s

    @property
    def active(self) -> bool:
        """Whether the history gives the model anything to do (tools, or a tool result)."""
        return bool(self._tools) or self._answer

    def next(self, h: int, *, allow_eos: bool) -> int | None:
        """The forced token at history hash ``h`` (None = the model's own).

        Call once per generated token: it advances the plan.
        """
        pos = self._pos
        self._pos += 1
        script = self._script
        if script is None:
            if not self.active or pos < self._after or not self._model.answer_boundary(h):
                return None
            if self._answer:  # answering a tool result: end here
                return EOS if allow_eos else None
            script = self._script = self._build(h)
        if self._at >= len(script):
            return None
        tid = script[self._at]
        self._at += 1
        if tid == EOS and not allow_eos:
            return None
        return tid

    def _build(self, h: int) -> list[int]:
        n = 1 if self._one else max(1, self._model.config.parallel_tool_calls)
        tok = self._model.tokenizer
        calls = [
            (t.name, [(k, kind, _value(h, i, j, kind)) for j, (k, kind) in enumerate(t.params)])
            for i, t in enumerate(self._tools[:n])
        ]
        return [*write(tok, self._fmt, calls), EOS]


Arg = tuple[str, str, list[int]]  # (key, "string" | "integer" | "number", value tokens)


def _value(h: int, call: int, arg: int, kind: str) -> list[int]:
    """A value's tokens: digits, or letters with a non-ASCII character and a quote in them.

    Strings are raw here (the quote a bare '"'); the writers escape for JSON.
    """
    def pick(k: int, n: int) -> int:
        return hash((h, _SALT, call, arg, k)) % n

    if kind != "string":
        digits = [ord("1") + pick(0, 9)]
        digits += [ord("0") + pick(k, 10) for k in range(1, 2 + pick(99, 3))]
        return digits
    letters = [ord("A") + pick(0, 26)] + [ord("a") + pick(k, 26) for k in range(1, 2 + pick(98, 3))]
    tail = [ord("a") + pick(k, 26) for k in range(10, 11 + pick(97, 2))]
    return [*letters, *_E_ACUTE, ord("a") + pick(50, 26), ord('"'), *tail]


def write(tok: Tokenizer, fmt: str, calls: Sequence[tuple[str, Sequence[Arg]]]) -> list[int]:
    """The tokens of these calls in the format (without the final EOS)."""
    enc = tok.encode
    out: list[int] = []
    for i, (name, args) in enumerate(calls):
        if fmt == "qwen3_xml":
            out += enc("\n") if i else []
            out += [_need(tok.tool_call_start), *enc(f"\n<function={name}>\n")]
            for key, _, value in args:
                out += [*enc(f"<parameter={key}>\n"), *value, *enc("\n</parameter>\n")]
            out += [*enc("</function>\n"), _need(tok.tool_call_end)]
            continue
        key = "parameters" if fmt == "llama3_json" else "arguments"
        body = [*enc(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": '),
                *_json_args(tok, args), *enc("}")]  # fmt: skip
        if fmt == "hermes":
            out += enc("\n") if i else []
            out += [_need(tok.tool_call_start), *enc("\n"), *body, *enc("\n"),
                    _need(tok.tool_call_end)]  # fmt: skip
        elif fmt == "llama3_json":
            out += [*(enc("; ") if i else [_need(tok.python_tag)]), *body]
        else:  # mistral
            out += [*(enc(", ") if i else [_need(tok.tool_calls_tag), *enc("[")]), *body]
    if fmt == "mistral" and calls:
        out += enc("]")
    return out


def _json_args(tok: Tokenizer, args: Sequence[Arg]) -> list[int]:
    out = tok.encode("{")
    for j, (key, kind, value) in enumerate(args):
        out += tok.encode((", " if j else "") + json.dumps(key, ensure_ascii=False) + ": ")
        if kind == "string":
            escaped = [t for v in value for t in ((ord("\\"), v) if v == ord('"') else (v,))]
            out += [ord('"'), *escaped, ord('"')]
        else:
            out += value
    return out + tok.encode("}")


def _need(tid: int | None) -> int:
    if tid is None:
        raise ValueError("the tokenizer has no tool-call tokens")
    return tid
