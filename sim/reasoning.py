"""vLLM's ``--reasoning-parser deepseek_r1`` for chat responses (pure).

Mirrors vllm/reasoning/deepseek_r1_reasoning_parser.py on top of
basic_parsers.BaseThinkingReasoningParser, as vLLM 0.32's chat server drives
it. Decisions go by token ids, the split by text:

* streaming (``R1Stream.delta``, once per chunk): a delta whose only token is
  ``<think>`` or ``</think>`` gives None (vLLM skips the chunk; see below);
  before the end token a delta is ``{"reasoning": text}``; a delta holding the
  end token among others is split at the text "</think>" into
  ``{"reasoning": before, "content": after or None}``; after the end token
  it is ``{"content": text}``. The token ids seen so far are the generated
  ones only: the template's ``<think>`` is in the prompt, so the R1 rules for
  "no start token" apply (the base class's own rules only when the model
  itself emits ``<think>``).
* non-streaming (``extract``): text after the first "<think>", if any, is
  split at the first "</think>"; no end token means all of it is reasoning
  and content is None; empty content is None.

A skipped chunk (None) is not sent unless it finishes the choice or the
request asked for ``return_token_ids``: then vLLM sends it with an empty
delta (``{}``) so that every token id reaches the client (serving_chat's
"if delta_message is None" branch). ``include_reasoning: false`` sets a
non-empty reasoning to null and drops the delta when nothing else is left.
/v1/completions runs no parser: its text keeps "</think>".
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sim.tokenizer import THINK_END, THINK_START

Delta = dict[str, Any]


class R1Stream:
    """Per-choice streaming state: which think tokens the output has had so far."""

    __slots__ = ("_start_id", "_end_id", "_saw_start", "_saw_end", "_include_reasoning")

    def __init__(self, start_id: int, end_id: int, *, include_reasoning: bool = True) -> None:
        self._start_id = start_id
        self._end_id = end_id
        self._saw_start = False
        self._saw_end = False
        self._include_reasoning = include_reasoning

    def delta(self, text: str, ids: Sequence[int]) -> Delta | None:
        """The chunk's delta for this text and these token ids; None = nothing to send."""
        delta = self._parse(text, ids)
        self._saw_start = self._saw_start or self._start_id in ids
        self._saw_end = self._saw_end or self._end_id in ids
        if delta is not None and delta.get("reasoning") and not self._include_reasoning:
            delta["reasoning"] = None
            if not delta.get("content"):
                return None
        return delta

    def _parse(self, text: str, ids: Sequence[int]) -> Delta | None:
        start, end = self._start_id, self._end_id
        if len(ids) == 1 and ids[0] in (start, end):
            return None
        if self._saw_start:
            if end in ids:
                return _split(text)
            return {"content": text} if self._saw_end else {"reasoning": text}
        if start in ids:
            if end in ids:
                i, j = text.find(THINK_START), text.find(THINK_END)
                after = text[j + len(THINK_END) :]
                return {"reasoning": text[i + len(THINK_START) : j], "content": after or None}
            return {"reasoning": text}
        # No start token generated: DeepSeek-R1 assumes it was in the prompt.
        if end in ids:
            return _split(text)
        return {"content": text} if self._saw_end else {"reasoning": text}


def _split(text: str) -> Delta:
    # Like vLLM, the id decides and the text is cut where "</think>" is found
    # (find() = -1 when the text lacks it is not special-cased there either).
    j = text.find(THINK_END)
    after = text[j + len(THINK_END) :]
    return {"reasoning": text[:j], "content": after or None}


def extract(text: str) -> tuple[str, str | None]:
    """Non-streaming split: (reasoning, content)."""
    before, sep, after = text.partition(THINK_START)
    text = after if sep else before
    if THINK_END not in text:
        return text, None
    reasoning, _, content = text.partition(THINK_END)
    return reasoning, content or None
