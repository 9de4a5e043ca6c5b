"""Pure stream stitching: one client stream out of the first backend's stream and the
resumed ones. Keeps the first stream's id/created/model/system_fingerprint, never sends a
second role delta, removes fields the client did not ask for (the token ids requested for
resume), converts resumed completion chunks to the client's format, runs stop strings
across the seam and answers include_usage over the whole generation."""

# baton: pure

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baton.model import Failure
from dataplane.relay.progress import ChoiceProgress
from dataplane.relay.resume import reasoning
from dataplane.relay.resume.reasoning import REASONING_FIELDS, THINK_TAGS, Markers
from dataplane.request import ClientRequest, Endpoint
from dataplane.sse import DONE_EVENT, sse
from dataplane.upstream.chunks import FAILED_FINISH, Choice, as_dict, parse_chunk

# `,"token_ids":[1,2]` or `,"prompt_token_ids":[...]` as engines write them (never first key).
TOKEN_FIELDS = re.compile(rb',\s*"(?:prompt_)?token_ids"\s*:\s*\[[\d,\s]*\]')
_EMPTY: dict[str, Any] = {}  # read only
_NO_CUT = object()  # original(): no decoded texts were asked for this choice
_PARSED = ("content", *REASONING_FIELDS)


def _other_fields(delta: Mapping[str, Any]) -> dict[str, Any]:
    """A delta less the fields its parser filled (role, tool calls... stay)."""
    return {k: v for k, v in delta.items() if k not in _PARSED}


@dataclass(frozen=True, slots=True)
class TagCut:
    """A first-stream chunk in which the engine merged a skipped end tag with other tokens
    (Stitcher._split_merged): what Baton must decode to split it by ids."""

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


@dataclass(slots=True)
class Identity:
    id: str = ""
    created: int = 0
    model: str = ""
    system_fingerprint: str | None = None


def expected_choices(client: ClientRequest) -> int:
    n = client.body.get("n") or 1
    prompt = client.body.get("prompt")
    if client.endpoint is Endpoint.COMPLETIONS and isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], str | list):
            return n * len(prompt)  # a batch of prompts: n choices each
    return int(n)


class Stitcher:
    def __init__(self, client: ClientRequest, *, strip_ids: bool) -> None:
        self.chat = client.endpoint is Endpoint.CHAT
        self._body = client.body
        self.strip_ids = strip_ids
        options = client.body.get("stream_options") or {}
        self.want_usage = bool(options.get("include_usage"))
        self.ident = Identity()
        self.choices: dict[int, ChoiceProgress] = {}
        self._prompt_ids: list[int] | None = None  # chat: top-level, shared by all choices
        # With stop strings an engine holds text back, so chunks show no character boundary.
        self._settles = not client.body.get("stop")
        # The first backend's reasoning parser (follow_reasoning): its name, and its think
        # tags when Baton can follow them across a resume.
        self._parser = ""
        self.markers: Markers | None = None
        # original(): the chunk just offered needs these texts decoded first (TagCut).
        self.wants: list[TagCut] = []
        self.usage: dict[str, Any] | None = None
        self.resumed = False
        self.extra_prompt_tokens: int | None = None  # text path: learned from a resume's usage
        # Every choice the client will get, so one that failed before its first chunk is
        # known to be unfinished too.
        for index in range(expected_choices(client)):
            self.choice(index)

    def choice(self, index: int) -> ChoiceProgress:
        p = self.choices.get(index)
        if p is None:
            p = self.choices[index] = ChoiceProgress(
                index, self._prompt_ids, settles=self._settles
            )
        return p

    def follow_reasoning(self, parser: str, markers: Markers | None) -> None:
        """The first backend runs reasoning parser `parser` ("" = none); `markers`: its
        think tags, None when Baton cannot follow that parser. Kept as this request's
        streams show them (a special tag's text is skipped unless the client said not to)."""
        self._parser = parser
        self.markers = markers.shown(self._body) if self.chat and markers is not None else None

    def unfinished(self) -> list[ChoiceProgress]:
        return [p for p in self.choices.values() if not p.finished]

    # -- the first backend's stream ------------------------------------------------------

    def original(
        self, data: bytes, raw: bytes, cuts: Mapping[int, CutText | None] | None = None
    ) -> tuple[bytes | None, Failure | None]:
        """One event of the first stream: (bytes for the client or None, failure or None).

        A chunk in which the engine merged a skipped end tag with other tokens is mis-split
        by vLLM's parser (TagCut): then nothing is tracked or sent yet, `wants` lists the
        texts Baton needs, and the caller calls again with them decoded (`cuts`, by choice
        index; None where they could not be had)."""
        chunk, failure = parse_chunk(data, len(self.choices))
        self.wants = []
        if chunk is None:
            return None, failure
        if cuts is None and self.markers is not None and self.markers.skipped:
            self.wants = [w for ch in chunk.choices or () if (w := self._tag_cut(ch))]
            if self.wants:
                return None, None
        if not self.ident.id:
            self.ident = Identity(chunk.id, chunk.created, chunk.model)
        if chunk.system_fingerprint:
            self.ident.system_fingerprint = chunk.system_fingerprint
        # Present on the first chunk only; vLLM's later chunks may carry it as null.
        if chunk.prompt_token_ids is not None:
            self._prompt_ids = chunk.prompt_token_ids
            for p in self.choices.values():
                p.prompt_ids = self._prompt_ids
                if self.markers is not None:
                    p.reasoning = reasoning.open_after(p.prompt_ids, self.markers)
                    p.thought_to = None if p.reasoning else 0
        choices = chunk.choices or ()
        if not choices and chunk.usage is not None:
            self.usage = chunk.usage
            return (self._clean(data, raw) if self.want_usage else None), None
        failed = False
        bare = True
        fixed: dict[int, dict[str, Any]] = {}
        for ch in choices:
            tracked = self._track(ch, cuts, fixed)
            if tracked is not None:
                failure, failed = tracked, True
            delta = fixed.get(ch.index, ch.delta)
            if bare and (delta != _EMPTY or ch.finish_reason is not None or ch.logprobs):
                bare = False
        if fixed:
            return self._repaired(data, fixed), failure
        if failed:
            return self._edited(data), failure
        if bare and self.strip_ids and self.chat:
            # A parser's skipped delta (a think or tool tag's token alone), sent only because
            # Baton asked for ids: without them the engine sends no such chunk.
            return None, None
        return self._clean(data, raw), None

    def _tag_cut(self, ch: Choice) -> TagCut | None:
        """What Baton must decode to send this chunk right, when it holds a skipped end tag
        among other tokens while reasoning is open; else None."""
        ids = ch.token_ids
        m = self.markers
        if not self.chat or m is None or not ids or len(ids) < 2 or m.end_id not in ids:
            return None
        p = self.choices.get(ch.index) or self.choice(ch.index)
        if not p.reasoning:
            return None
        j = list(ids).index(m.end_id)
        tag_at = len(p.token_ids) + j
        at, text_at = 0, 0
        if p.settles:
            at, text_at = next(((a, t) for a, t in reversed(p.settled) if a <= tag_at), (0, 0))
        before = p.token_ids[at:] + list(ids[:j])
        delta = ch.delta or _EMPTY
        # vLLM sends content = text[7:]: empty when the text is shorter than the tag, and
        # then the chunk's last character never came; its ids after the tag give it.
        after = list(ids[j + 1 :]) if not delta.get("content") else []
        return TagCut(ch.index, before, after, p.text[text_at:])

    def _track(
        self, ch: Choice, cuts: Mapping[int, CutText | None] | None, fixed: dict[int, Any]
    ) -> Failure | None:
        p = self.choices.get(ch.index) or self.choice(ch.index)
        if ch.prompt_token_ids is not None:  # vLLM: null after the first chunk
            p.prompt_ids = ch.prompt_token_ids
        ids = ch.token_ids
        if self.chat:
            delta = ch.delta or _EMPTY
            if delta.get("tool_calls"):
                p.tool_call = True
            cut = cuts.get(ch.index) if cuts is not None and ch.index in cuts else _NO_CUT
            text, repaired = self._raw(p, delta, ids or (), cut)
            p.add(text, ids)
            if repaired is not None:
                fixed[ch.index] = {**_other_fields(delta), **repaired}
                delta = repaired
            if self.markers is not None:
                self._said(p, delta)
        else:
            p.add(ch.text or "", ids)
        finish = ch.finish_reason
        if finish is None:
            return None
        if finish in FAILED_FINISH:
            # The text up to here is real; the finish is the engine's failure, not the answer.
            return Failure.finish(finish)
        if finish:
            p.finish_reason = finish
            p.stop_reason = ch.stop_reason
        return None

    @staticmethod
    def _said(p: ChoiceProgress, delta: Mapping[str, Any]) -> None:
        """The client gets `delta`: kept as what it has of each field."""
        for key in REASONING_FIELDS:
            value = delta.get(key)
            if isinstance(value, str):
                p.said_reasoning.add(value)
        content = delta.get("content")
        if isinstance(content, str):
            p.said_content.add(content)

    def _edited(self, data: bytes) -> bytes:
        """The chunk with an engine's failed finish taken out (the text in it is real and
        goes to the client; the stream fails over after it)."""
        obj = as_dict(data)
        for ch in obj.get("choices") or ():
            if ch.get("finish_reason") in FAILED_FINISH:
                ch["finish_reason"] = None
                ch.pop("stop_reason", None)
        return self._clean(b"", b"", obj)

    def _repaired(self, data: bytes, fixed: Mapping[int, dict[str, Any]]) -> bytes | None:
        """The chunk with the deltas Baton split by ids in place of the parser's (and an
        engine's failed finish taken out); None when no choice is left with anything."""
        obj = as_dict(data)
        for ch in obj.get("choices") or ():
            if ch.get("index") in fixed:
                ch["delta"] = fixed[ch["index"]]
            if ch.get("finish_reason") in FAILED_FINISH:
                ch["finish_reason"] = None
                ch.pop("stop_reason", None)
        return self._clean(b"", b"", obj)

    def _raw(
        self,
        p: ChoiceProgress,
        delta: Mapping[str, Any],
        ids: Sequence[int],
        cut: CutText | None | object = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """A parsed delta's text as the engine generated it (reasoning, the end tag's text
        as the stream shows it if its token is here, content), keeping track of where
        reasoning ends: by the tags' ids, whatever their text. The second item: the delta
        the client gets instead of the engine's, where the engine's parser mis-split it
        (`cut`: the decoded texts _tag_cut asked for; None: they could not be had)."""
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
        self, p: ChoiceProgress, thought: str, content: str, cut: CutText | None | object
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
        if isinstance(cut, CutText):
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

    def _delta(
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

    def _clean(self, data: bytes, raw: bytes, obj: dict[str, Any] | None = None) -> bytes:
        """The event for the client: `raw` as the engine sent it, less the token ids it did
        not ask for. `obj`: the chunk as edited (then serialised again)."""
        if obj is None:
            if raw and self.strip_ids:
                # Cut the id arrays out of the bytes as they came: integer arrays can't hide
                # in a JSON string (quotes are escaped there), and this is the per-token hot
                # path.
                cut = TOKEN_FIELDS.sub(b"", raw)
                if b"token_ids" not in cut:
                    return cut
            if not self.strip_ids and raw:
                return raw
            obj = as_dict(data)
        if self.strip_ids:
            obj.pop("prompt_token_ids", None)
            for ch in obj.get("choices") or ():
                ch.pop("token_ids", None)
                ch.pop("prompt_token_ids", None)
        return sse(obj)

    # -- resumed streams -----------------------------------------------------------------

    def resumed_chunk(
        self,
        p: ChoiceProgress,
        text: str,
        ids: list[int],
        finish: str | None = None,
        stop_reason: str | int | None = None,
        *,
        settled: bool = False,
        cut: int | None = None,
    ) -> bytes:
        """A resumed chunk: recorded in the choice's progress, then shaped for the client
        (chunk()). `settled`: Baton decoded the text itself, so it covers every id. `cut`:
        where the text meets the end of thinking, when needs_cut() asked for it."""
        p.add(text, ids, settled=settled)
        if finish:
            p.end(finish, stop_reason)
        return self.chunk(p.index, text, ids, finish, stop_reason, cut=cut)

    def ended_at_limit(self, p: ChoiceProgress, held_text: str = "") -> bytes:
        """A choice that had all its max_tokens before the failure, only its finish lost:
        "length", as the engine would have ended it, with the text it held back for a stop
        string (its tokens are counted already)."""
        p.end("length", None, held_text)
        return self.chunk(p.index, held_text, [], "length")

    def chunk(
        self,
        index: int,
        text: str,
        ids: list[int],
        finish: str | None = None,
        stop_reason: str | int | None = None,
        *,
        cut: int | None = None,
    ) -> bytes:
        """A chunk in the client's format, as if the first backend had sent it; b"" when it
        would carry nothing the client wants (no text, no finish, ids it did not ask for;
        the end tag's token alone, for which a parser sends no delta). Every resumed chunk
        comes through here: it keeps the reasoning state."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            p = self.choice(index)
            choice["delta"] = delta = self._delta(p, text, ids, cut)
            if self.markers is not None:
                self._said(p, delta)
            empty = not delta
        else:
            choice["text"] = text
            empty = not text
        if empty and not finish and (self.strip_ids or not ids):
            return b""
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        if finish:
            choice["stop_reason"] = stop_reason
        if not self.strip_ids:
            choice["token_ids"] = ids
        obj: dict[str, Any] = {
            "id": self.ident.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.ident.created,
            "model": self.ident.model,
            "choices": [choice],
        }
        if finish and self.ident.system_fingerprint:
            obj["system_fingerprint"] = self.ident.system_fingerprint
        return sse(obj)

    def ending(self) -> bytes:
        """Usage over the whole generation (when asked and a resume happened), then [DONE]."""
        if not (self.want_usage and self.resumed):
            return DONE_EVENT
        prompt, completion = self.token_counts()
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        obj: dict[str, Any] = {
            "id": self.ident.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.ident.created,
            "model": self.ident.model,
            "choices": [],
            "usage": usage,
        }
        if self.ident.system_fingerprint:
            obj["system_fingerprint"] = self.ident.system_fingerprint
        return sse(obj) + DONE_EVENT

    def token_counts(self) -> tuple[int, int]:
        """Prompt and generated tokens of the whole generation, every backend's included."""
        return self._prompt_tokens(), sum(p.generated for p in self.choices.values())

    def _prompt_tokens(self) -> int:
        ids = next((p.prompt_ids for p in self.choices.values() if p.prompt_ids), None)
        if ids is not None:
            return len(ids)
        if self.usage is not None:
            return int(self.usage.get("prompt_tokens", 0))
        return self.extra_prompt_tokens or 0
