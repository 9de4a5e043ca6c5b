"""Reasoning in a chat stream, kept by the think tags' ids (pure): the stitcher's part
that knows where reasoning ends. The first stream's parsed deltas are tracked as the engine's
raw text; a chunk vLLM's parser mis-split (a skipped special end tag merged with other
tokens) is split again by ids (TagCut, CutText); a resumed raw stream, which no parser ran
on, is split the way vLLM's deepseek_r1 parser would (dataplane/relay/resume/reasoning.py has
the rules); and what the client is sent in each field is tallied for the seam verdict
(ChoiceProgress.fields_agree)."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume import reasoning
from dataplane.relay.resume.reasoning import REASONING_FIELDS, THINK_TAGS, Markers
from dataplane.upstream.chunks import Choice

_EMPTY: dict[str, Any] = {}  # read only
_PARSED = ("content", *REASONING_FIELDS)


def other_fields(delta: Mapping[str, Any]) -> dict[str, Any]:
    """A delta less the fields its parser filled (role, tool calls... stay)."""
    return {k: v for k, v in delta.items() if k not in _PARSED}


@dataclass(frozen=True, slots=True)
class TagCut:
    """A first-stream chunk in which the engine merged a skipped end tag with other tokens
    (Thinking._split_merged): what Baton must decode to split it by ids."""

    index: int  # the choice
    before: list[int]  # ids from the last known character boundary up to the tag
    after: list[int]  # ids after the tag, when the engine lost the chunk's last character
    sent: str  # the client's raw text since that boundary


@dataclass(frozen=True, slots=True)
class CutText:
    """A TagCut's ids decoded: `before` from the boundary (what the client has since it
    included), `after` (settled to a character boundary) or None when not asked."""

    sent: str
    before: str
    after: str | None

    def before_part(self) -> str | None:
        """The chunk's text before the tag; None when the ids' text does not lead up to it."""
        return self.before[len(self.sent) :] if self.before.startswith(self.sent) else None



class Thinking:
    """One request's reasoning split. `markers` None: Baton does not follow the backend's
    parser (or there is none); a stream that shows reasoning then is refused a resume."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self._body = body
        self._parser = ""
        self.markers: Markers | None = None

    def follow(self, parser: str, markers: Markers | None) -> None:
        """The first backend runs reasoning parser `parser` ("" = none); `markers`: its
        think tags, None when Baton cannot follow that parser. Kept as this request's
        streams show them (a special tag's text is skipped unless the client said not to)."""
        self._parser = parser
        self.markers = markers.shown(self._body) if markers is not None else None

    def tag_cut(self, p: ChoiceProgress, ch: Choice) -> TagCut | None:
        """What Baton must decode to send this chunk right, when it holds a skipped end tag
        among other tokens while reasoning is open; else None."""
        ids = ch.token_ids
        m = self.markers
        if m is None or not ids or len(ids) < 2 or m.end_id not in ids:
            return None
        if not p.reasoning:
            return None
        j = list(ids).index(m.end_id)
        tag_at = len(p.token_ids) + j
        at, text_at = 0, 0
        if p.settles:
            at, text_at = next(((a, t) for a, t in reversed(p.settled) if a <= tag_at), (0, 0))
        before = p.ids(at) + list(ids[:j])
        delta = ch.delta or _EMPTY
        # vLLM sends content = text[7:]: empty when the text is shorter than the tag, and
        # then the chunk's last character never came; its ids after the tag give it.
        after = list(ids[j + 1 :]) if not delta.get("content") else []
        return TagCut(ch.index, before, after, p.text[text_at:])

    @staticmethod
    def said(p: ChoiceProgress, delta: Mapping[str, Any]) -> None:
        """The client gets `delta`: kept as what it has of each field."""
        for key in REASONING_FIELDS:
            value = delta.get(key)
            if isinstance(value, str):
                p.said_reasoning.add(value)
        content = delta.get("content")
        if isinstance(content, str):
            p.said_content.add(content)

    def raw(
        self,
        p: ChoiceProgress,
        delta: Mapping[str, Any],
        ids: Sequence[int],
        cut: CutText | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """A parsed delta's text as the engine generated it (reasoning, the end tag's text
        as the stream shows it if its token is here, content), keeping track of where
        reasoning ends: by the tags' ids, whatever their text. The second item: the delta
        the client gets instead of the engine's, where the engine's parser mis-split it
        (`cut`: the decoded texts tag_cut asked for; None: none were had)."""
        content = delta.get("content") or ""
        thought = ""
        for key in REASONING_FIELDS:
            value = delta.get(key)
            if isinstance(value, str) and value:
                thought, p.reasoning_field = value, key
                break
        if thought and self.markers is None and not p.unfollowed:
            p.unfollowed = (
                f"the reasoning of reasoning parser {self._parser!r} cannot be kept across a resume"
                if self._parser
                else "the backend streams reasoning but names no reasoning_parser"
            )
        m = self.markers
        if m is None:
            return thought + content, None
        if len(ids) == 1 and ids[0] == m.start_id:
            if p.reasoning:
                p.thought_from = p.text_len + len(m.start_text)
            return m.start_text, None  # the tag alone: the parser sends no text for it
        if p.reasoning and m.end_id in ids:
            p.reasoning = False
            if m.end_text or len(ids) == 1:
                p.thought_to = p.text_len + len(thought)
                p.reply_start = p.thought_to + len(m.end_text)
                return thought + m.end_text + content, None
            return self._split_merged(p, thought, content, cut)
        if content and p.reasoning:
            # Content while reasoning looked open: the engine's parser knows better.
            p.reasoning = False
            p.thought_to = p.reply_start = p.text_len + len(thought)
        return thought + content, None

    def _split_merged(
        self, p: ChoiceProgress, thought: str, content: str, cut: CutText | None
    ) -> tuple[str, dict[str, Any] | None]:
        """A skipped end tag merged with other tokens. vLLM's parser cut the chunk at
        text.find(tag) == -1, so it sent reasoning = text[:-1] and content = text[7:] (for
        "</think>"): the answer's start labelled reasoning, the reasoning's tail repeated as
        content, and, for a text shorter than the tag, its last character lost (vLLM
        PR #53303, open). Baton knows the tag's place among the ids, so it rebuilds the text
        and splits it there: `cut` holds the text of the ids before the tag (and after it,
        where the engine lost the last character)."""
        tag = THINK_TAGS[self._parser][1]
        text = reasoning.unmangle(thought, content, tag)
        if cut is not None:
            before = cut.before_part()
            if text is None and before is not None and cut.after is not None:
                text = before + cut.after
            if text is not None and before is not None and text.startswith(before):
                if text[:-1] == thought or (not text and not thought):
                    p.thought_to = p.reply_start = p.text_len + len(before)
                    field = p.reasoning_field or REASONING_FIELDS[0]
                    fixed = {field: text[: len(before)], "content": text[len(before) :]}
                    return text, {k: v for k, v in fixed.items() if v}
        # The ids' text does not lead up to the chunk's (or could not be had): relay what
        # the engine sent, and refuse to resume a stream whose split Baton cannot keep.
        p.unfollowed = (
            "the end of thinking could not be placed in a chunk the engine merged with it"
        )
        raw = text if text is not None else thought
        p.thought_to = p.reply_start = p.text_len + len(raw) - len(content)
        return raw, None

    def needs_cut(self, p: ChoiceProgress, ids: Sequence[int], raw: str) -> int | None:
        """For a resumed chunk about to be shaped (not yet in `p`): when its text must be
        cut where the end tag's token stands and the tag's text (skipped) cannot show
        where, the tag's index among the choice's generated ids, for the caller to find the
        cut from the ids (the text of those before it); else None."""
        m = self.markers
        if m is None or not p.reasoning or m.end_text or not raw:
            return None
        if p.end_pending:
            return p.end_at
        if m.end_id in ids:
            return len(p.token_ids) + list(ids).index(m.end_id)
        return None

    def delta(
        self, p: ChoiceProgress, raw: str, ids: Sequence[int], cut: int | None
    ) -> dict[str, Any]:
        """A resumed chunk's raw text as the first backend's parser would have sent it.
        Called after p.add(raw, ids). `cut`: how much of `raw` comes before the end tag,
        when its text is skipped (needs_cut)."""
        m = self.markers
        if m is None or not p.reasoning:
            return {"content": raw} if raw else {}
        field = p.reasoning_field or REASONING_FIELDS[0]
        if m.end_id in ids and not p.end_pending:
            p.end_pending = True
            p.end_at = len(p.token_ids) - len(ids) + list(ids).index(m.end_id)
        if p.end_pending and not raw and not m.end_text and p.settled[-1][0] == p.end_at:
            # A skipped tag at a character boundary: all reasoning is out, the rest is content.
            p.reasoning = p.end_pending = False
            p.thought_to = p.reply_start = p.text_len
            return {}
        if not p.end_pending or not raw:
            return {field: raw} if raw else {}
        if m.end_text:
            parts = reasoning.split(raw, m)
        elif cut is not None:
            parts = raw[:cut], raw[cut:]
        else:
            # No cut found from ids (a chunk shaped without them): the tag's place among
            # this chunk's ids says which side its text is on.
            first = bool(ids) and ids[0] == m.end_id and p.end_at == len(p.token_ids) - len(ids)
            parts = ("", raw) if first else (raw, "")
        if parts is None:
            return {field: raw}
        thought, content = parts
        p.reasoning = p.end_pending = False
        p.reply_start = p.text_len - len(content)
        p.thought_to = p.reply_start - len(m.end_text)
        delta: dict[str, Any] = {}
        if thought:
            delta[field] = thought
        if content:
            delta["content"] = content
        return delta
