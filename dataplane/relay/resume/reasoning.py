"""Reasoning across a seam (pure). An engine running a reasoning parser splits a chat
stream into `reasoning` deltas and `content` deltas; a token-path resume runs on
/v1/completions, which runs no parser, so Baton keeps the split itself, from the token ids,
the way vLLM's think-tag parsers (deepseek_r1) do it:

- whether reasoning is open when generation starts: the prompt's last think tag is the
  start tag, or there is none (vLLM `is_reasoning_end` on the prompt ids, negated);
- reasoning goes on until the end tag's token is generated; the text of the tokens before
  it is reasoning, the text of the tokens after it is content, the tag's own text is
  dropped;
- after it everything is content.

The switch is decided by the end tag's id alone, never by its text: a tokenizer may mark
the tags special, and then a stream decoded with skip_special_tokens (vLLM's default)
never shows their text at all (`Markers.special`). Baton holds every id, so it knows where
the tag is; where the text of one chunk must be cut around a tag whose text is not there,
the caller finds the cut from the ids (dataplane/relay/resume/resumed.py).

Only parsers listed in THINK_TAGS are followed; a stream from any other parser that shows
reasoning is refused a resume, explicitly, rather than re-labelled."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

# vLLM --reasoning-parser names whose rules are the ones above, with their tags.
THINK_TAGS: dict[str, tuple[str, str]] = {"deepseek_r1": ("<think>", "</think>")}
# The delta fields engines put reasoning in: vLLM 0.32's, then the older name.
REASONING_FIELDS = ("reasoning", "reasoning_content")


@dataclass(frozen=True, slots=True)
class Markers:
    """One model's think tags as token ids (learned from its engine,
    dataplane/relay/resume/markers.py), and the text each shows in a stream: the tag's own, or ""
    where a special tag is skipped."""

    start_id: int
    end_id: int
    start_text: str
    end_text: str
    # The engine's tokenizer marks the tags special: skip_special_tokens drops their text.
    special: bool = False

    def shown(self, body: Mapping[str, Any]) -> Markers:
        """These tags as a stream for request `body` decodes them: a special tag's text is
        "" unless the request turns skip_special_tokens off."""
        if self.special and body.get("skip_special_tokens", True) is not False:
            return replace(self, start_text="", end_text="")
        return self

    @property
    def skipped(self) -> frozenset[int]:
        """The tags whose text a stream does not show (after shown())."""
        return frozenset(
            t for t, text in ((self.start_id, self.start_text), (self.end_id, self.end_text))
            if not text
        )  # fmt: skip


def open_after(prompt_ids: Sequence[int], m: Markers) -> bool:
    """Whether reasoning is open once the prompt has been read."""
    for t in reversed(prompt_ids):
        if t == m.start_id:
            return True
        if t == m.end_id:
            return False
    return True  # no tag: deepseek_r1 takes everything before the end tag as reasoning


def split(raw: str, m: Markers) -> tuple[str, str] | None:
    """(reasoning, content) of text in which the end tag's token was generated, cut where
    the tag's text is; None while the tag's text has not come yet (held back with bytes
    before it). Only for a tag that shows its text (m.end_text)."""
    at = raw.find(m.end_text)
    if at < 0:
        return None
    return raw[:at], raw[at + len(m.end_text) :]


def unmangle(thought: str, content: str, tag: str) -> str | None:
    """The text of one chunk that vLLM's parser split around the end tag `tag` whose text the
    stream skipped, or None when it cannot be told. vLLM cuts at delta_text.find(tag), which
    is -1 there, so it sends reasoning = text[:-1] and content = text[len(tag) - 1:] (for
    "</think>": text[7:]): the last character doubles as content's, and content is empty
    when the text is shorter than the tag."""
    if len(thought) >= len(tag) - 1 and content:
        return thought + content[-1]
    return None  # content empty: the text's last character (if it had one) never came


def segments(ids: Sequence[int], skipped: frozenset[int]) -> list[list[int]]:
    """`ids` cut at every token in `skipped` (dropped): decoding each part apart and joining
    them gives what a stream shows, where a plain decode (an engine's /detokenize) would
    spell the skipped tags."""
    out: list[list[int]] = [[]]
    for t in ids:
        if t in skipped:
            out.append([])
        else:
            out[-1].append(t)
    return [part for part in out if part]
