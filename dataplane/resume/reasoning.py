"""Reasoning across a seam (pure). An engine running a reasoning parser splits a chat
stream into `reasoning` deltas and `content` deltas; a token-path resume runs on
/v1/completions, which runs no parser, so Baton keeps the split itself, from the token ids,
the way vLLM's think-tag parsers (deepseek_r1) do it:

- whether reasoning is open when generation starts: the prompt's last think tag is the
  start tag, or there is none (vLLM `is_reasoning_end` on the prompt ids, negated);
- reasoning goes on until the end tag's token is generated; that token's text is dropped,
  the text before it in the same delta is reasoning and the text after it is content;
- after it everything is content.

Only parsers listed in THINK_TAGS are followed; a stream from any other parser that shows
reasoning is refused a resume, explicitly, rather than re-labelled."""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# vLLM --reasoning-parser names whose rules are the ones above, with their tags.
THINK_TAGS: dict[str, tuple[str, str]] = {"deepseek_r1": ("<think>", "</think>")}
# The delta fields engines put reasoning in: vLLM 0.32's, then the older name.
REASONING_FIELDS = ("reasoning", "reasoning_content")


@dataclass(frozen=True, slots=True)
class Markers:
    """One model's think tags as token ids (learned from its engine's /tokenize)."""

    start_id: int
    end_id: int
    end_text: str


def open_after(prompt_ids: Sequence[int], m: Markers) -> bool:
    """Whether reasoning is open once the prompt has been read."""
    for t in reversed(prompt_ids):
        if t == m.start_id:
            return True
        if t == m.end_id:
            return False
    return True  # no tag: deepseek_r1 takes everything before the end tag as reasoning


def split(raw: str, m: Markers) -> tuple[str, str] | None:
    """(reasoning, content) of text in which the end tag's token was generated; None while
    the tag's text has not come yet (held back with bytes before it)."""
    at = raw.find(m.end_text)
    if at < 0:
        return None
    return raw[:at], raw[at + len(m.end_text) :]
