"""Pure stream stitching: one client stream out of the first backend's stream and the
resumed ones. Keeps the first stream's id/created/model/system_fingerprint, never sends a
second role delta, removes fields the client did not ask for (the token ids requested for
resume), converts resumed completion chunks to the client's format, runs stop strings
across the seam and answers include_usage over the whole generation."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from baton.model import Failure
from dataplane.relay import logprobs, runs
from dataplane.relay.progress import ChoiceProgress, Ids, id_array
from dataplane.relay.resume import generate
from dataplane.relay.resume.reasoning import Markers, open_after
from dataplane.relay.shape import Identity, expected_choices
from dataplane.relay.strip import client_event, edited, strip_ids
from dataplane.relay.thinking import CutText, TagCut, Thinking, other_fields
from dataplane.relay.tools.follow import ToolFollow, runs_tool_parser
from dataplane.relay.tools.parsers import keeps_special, parser_for
from dataplane.request import ClientRequest, Endpoint
from dataplane.sse import DONE_EVENT, sse
from dataplane.upstream.chunks import FAILED_FINISH, Choice, Chunk, parse_chunk

_EMPTY: dict[str, Any] = {}  # read only
NO_TOOL_PARSER = "tool calls cannot be followed: the backend names no tool_parser"
class Stitcher:
    def __init__(self, client: ClientRequest, *, strip_ids: bool) -> None:
        self.chat = client.endpoint is Endpoint.CHAT
        self._body = client.body
        self.strip_ids = strip_ids
        options = client.body.get("stream_options") or {}
        self.want_usage = bool(options.get("include_usage"))
        self.ident = Identity()
        self.choices: dict[int, ChoiceProgress] = {}
        self._prompt_ids: Ids | None = None  # chat: top-level, shared by all choices
        # With stop strings an engine holds text back, so chunks show no character boundary.
        self._settles = not client.body.get("stop")
        # The reasoning split by the think tags' ids (follow_reasoning).
        self.thinking = Thinking(client.body)
        # The tool calls, read by Baton's copy of the backend's tool parser (follow_tools).
        self.tools: ToolFollow | None = None
        # The engine's parsers turn skip_special_tokens off for this request (follow_tools).
        self._keeps_special = False
        # Top candidates per token the client's stream carries (None: no logprobs).
        self.logprobs_k = generate.logprobs_wanted(client)
        # original(): the chunk just offered needs these texts decoded first (TagCut).
        self.wants: list[TagCut] = []
        self.usage: dict[str, Any] | None = None
        self.resumed = False
        self.extra_prompt_tokens: int | None = None  # text path: learned from a resume's usage
        # Every choice the client will get, so one that failed before its first chunk is
        # known to be unfinished too.
        for index in range(expected_choices(client)):
            self.choice(index)
        if self.chat and runs_tool_parser(client.body):
            # Until follow_tools names a parser Baton follows: the calls could not be kept.
            for p in self.choices.values():
                p.unfollowed = NO_TOOL_PARSER

    def choice(self, index: int) -> ChoiceProgress:
        p = self.choices.get(index)
        if p is None:
            p = self.choices[index] = ChoiceProgress(
                index, self._prompt_ids, settles=self._settles
            )
        return p

    def follow_tools(
        self, parser: str, new_id: Callable[[], str], *, reasoning: bool = False
    ) -> None:
        """The first backend runs tool parser `parser` ("" = none) and, when `reasoning`, a
        reasoning parser; `new_id()` makes a tool call's id. Called before follow_reasoning:
        where the engine keeps special tokens' text, the think tags show it."""
        if self.chat and keeps_special(parser, self._body, reasoning=reasoning):
            self._keeps_special = True
            self.thinking = Thinking({**self._body, "skip_special_tokens": False})
        if not (self.chat and runs_tool_parser(self._body)):
            return
        follower = parser_for(parser, self._body["tools"]) if parser else None
        if follower is None:
            if parser:
                why = f"the tool calls of tool parser {parser!r} cannot be kept across a resume"
                for p in self.choices.values():
                    p.unfollowed = why
            return
        for p in self.choices.values():
            p.unfollowed = ""  # (NO_TOOL_PARSER, until now)
        first_only = self._body.get("parallel_tool_calls") is False
        self.tools = ToolFollow(follower, new_id, first_only=first_only)

    @property
    def resume_fields(self) -> dict[str, Any]:
        """What a resume request must set beyond the client's body to decode as the first
        stream did."""
        return {"skip_special_tokens": False} if self._keeps_special else {}

    def fields_agree(self, p: ChoiceProgress) -> bool:
        """Whether the reasoning and content the client assembled are the split by ids (the
        content as the tool parser reads the reply, when one is followed)."""
        if self.tools is None or p.content_sent < 0:
            return p.fields_agree()
        return p.fields_agree(self.tools.parser.parse(p.reply, final=p.finished).content)

    def follow_reasoning(self, parser: str, markers: Markers | None) -> None:
        """The first backend runs reasoning parser `parser` ("" = none); `markers`: its
        think tags, None when Baton cannot follow that parser. Kept as this request's
        streams show them (a special tag's text is skipped unless the client said not to)."""
        self.thinking.follow(parser, markers if self.chat else None)

    @property
    def markers(self) -> Markers | None:
        """The think tags as this request's streams show them; None: not followed."""
        return self.thinking.markers

    def unfinished(self) -> list[ChoiceProgress]:
        return [p for p in self.choices.values() if not p.finished]

    # -- the first backend's stream ------------------------------------------------------

    def original(
        self, data: bytes, raw: bytes, cuts: Mapping[int, CutText] | None = None
    ) -> tuple[bytes | None, Failure | None]:
        """One event of the first stream: (bytes for the client or None, failure or None).

        A chunk in which the engine merged a skipped end tag with other tokens is mis-split
        by vLLM's parser (TagCut): then nothing is tracked or sent yet, `wants` lists the
        texts Baton needs, and the caller calls again with them decoded (`cuts`, by choice
        index; a choice missing there: its engine's chunk goes out as it came)."""
        chunk, failure = parse_chunk(data, len(self.choices))
        self.wants = []
        if chunk is None:
            return None, failure
        if self.plain:
            out = self._plain(chunk, raw)
            if out is not None:
                return out, None
        if cuts is None and self.markers is not None and self.markers.skipped:
            self.wants = [w for ch in chunk.choices or () if self.chat and
                          (w := self.thinking.tag_cut(self.choice(ch.index), ch))]  # fmt: skip
            if self.wants:
                return None, None
        if not self.ident.id:
            self.ident = Identity(chunk.id, chunk.created, chunk.model)
        if chunk.system_fingerprint:
            self.ident.system_fingerprint = chunk.system_fingerprint
        # Present on the first chunk only; vLLM's later chunks may carry it as null.
        if chunk.prompt_token_ids is not None:
            self._prompt_ids = id_array(chunk.prompt_token_ids)
            for p in self.choices.values():
                p.prompt_ids = self._prompt_ids
                if self.markers is not None:
                    p.reasoning = open_after(p.prompt_ids, self.markers)
                    p.thought_to = None if p.reasoning else 0
        choices = chunk.choices or ()
        if not choices and chunk.usage is not None:
            self.usage = chunk.usage
            return (client_event(data, raw, self.strip_ids) if self.want_usage else None), None
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
            return edited(data, fixed, self.strip_ids), failure
        if failed:
            return edited(data, {}, self.strip_ids), failure
        if bare and self.strip_ids and self.chat:
            # A parser's skipped delta (a think or tool tag's token alone), sent only because
            # Baton asked for ids: without them the engine sends no such chunk.
            return None, None
        return client_event(data, raw, self.strip_ids), None

    @property
    def plain(self) -> bool:
        """Whether a plain chunk (_plain, plain_run) goes out as the engine sent it, less its
        ids, with nothing per token to follow: the client wants no ids, the stream's identity
        is known (its first chunk came), no logprobs, no reasoning followed."""
        return (self.strip_ids and bool(self.ident.id) and self.logprobs_k is None
                and self.markers is None)  # fmt: skip

    def plain_run(self, run: bytes, n: int) -> bytes | None:
        """n whole events of the first stream as one (dataplane/relay/runs.py): the client's
        bytes for them, or None, nothing tracked, when one is not a plain chunk (the caller
        then offers them one by one to original())."""
        if not self.plain or len(self.choices) != 1:
            return None
        got = runs.decode(run, n, self.chat)
        if got is None:
            return None
        if got.fingerprint:
            self.ident.system_fingerprint = got.fingerprint
        self.choices[0].add_run(got.texts, got.ids)
        return got.client

    def _plain(self, chunk: Chunk, raw: bytes) -> bytes | None:
        """Most of a stream, in one step: a chunk of one choice with text and ids, no finish,
        no other field (a stream without reasoning followed or logprobs asked for). None:
        not such a chunk, the general path takes it."""
        chs = chunk.choices
        if not chs or len(chs) > 1 or chunk.prompt_token_ids is not None:
            return None
        ch = chs[0]
        if ch.finish_reason is not None or ch.logprobs is not None:
            return None
        if ch.prompt_token_ids is not None:
            return None
        if self.chat:
            delta = ch.delta
            text = delta.get("content") if delta is not None and len(delta) == 1 else None
            if text is None:
                return None  # a role, tool calls, reasoning, an empty delta...
        else:
            text = ch.text or ""
        cut = strip_ids(raw) if raw else None
        if cut is None:
            return None
        if chunk.system_fingerprint:
            self.ident.system_fingerprint = chunk.system_fingerprint
        self.choices[ch.index].add(text, ch.token_ids)
        return cut

    def _track(
        self, ch: Choice, cuts: Mapping[int, CutText] | None, fixed: dict[int, Any]
    ) -> Failure | None:
        p = self.choices.get(ch.index) or self.choice(ch.index)
        if ch.prompt_token_ids is not None:  # vLLM: null after the first chunk
            p.prompt_ids = id_array(ch.prompt_token_ids)
        ids = ch.token_ids
        if self.chat:
            delta = ch.delta or _EMPTY
            if delta.get("tool_calls"):
                if self.tools is not None:
                    self.tools.said(p, delta["tool_calls"])
                else:
                    p.tool_call = True
            cut = cuts.get(ch.index) if cuts is not None else None
            text, repaired = self.thinking.raw(p, delta, ids or (), cut)
            p.add(text, ids)
            if repaired is not None:
                fixed[ch.index] = {**other_fields(delta), **repaired}
                delta = repaired
            if self.markers is not None:
                Thinking.said(p, delta)
        else:
            p.add(ch.text or "", ids)
            if self.logprobs_k is not None and isinstance(ch.logprobs, dict):
                p.logprob_offset = logprobs.next_offset(ch.logprobs, p.logprob_offset)
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
        entries: list[dict[str, Any]] | None = None,
    ) -> bytes:
        """A resumed chunk: recorded in the choice's progress, then shaped for the client
        (chunk()). `settled`: Baton decoded the text itself, so it covers every id. `cut`:
        where the text meets the end of thinking, when Thinking.needs_cut asked for it.
        `entries`: its tokens' logprobs in chat's shape (generate.py), when asked for."""
        p.add(text, ids, settled=settled)
        if finish:
            if self.tools is not None:
                finish = ToolFollow.finish(p, finish)
            p.end(finish, stop_reason)
        return self.chunk(p.index, text, ids, finish, stop_reason, cut=cut, entries=entries)

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
        entries: list[dict[str, Any]] | None = None,
    ) -> bytes:
        """A chunk in the client's format, as if the first backend had sent it; b"" when it
        would carry nothing the client wants (no text, no finish, ids it did not ask for;
        the end tag's token alone, for which a parser sends no delta). Every resumed chunk
        comes through here: it keeps the reasoning state."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            p = self.choice(index)
            choice["delta"] = delta = self.thinking.delta(p, text, ids, cut)
            if self.tools is not None and not p.reasoning:
                if p.content_sent < 0:
                    p.content_sent = 0  # the reply began in this resume: the client has none
                delta.pop("content", None)
                delta.update(self.tools.delta(p, final=finish is not None))
                if finish is not None:
                    finish = ToolFollow.finish(p, finish)
            if self.markers is not None:
                Thinking.said(p, delta)
            empty = not delta
        else:
            choice["text"] = text
            empty = not text
        if empty and not finish and (self.strip_ids or not ids) and not entries:
            return b""  # (an engine sends a chunk with logprobs even when it has no text)
        choice["logprobs"] = self._logprobs(index, entries)
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

    def _logprobs(self, index: int, entries: list[dict[str, Any]] | None) -> Any:
        """A resumed chunk's logprobs in the client's shape (None when it asked for none)."""
        k = self.logprobs_k
        if k is None or entries is None:
            return None
        if self.chat:
            return logprobs.as_chat(entries, k)
        p = self.choice(index)
        shaped, p.logprob_offset = logprobs.as_completions(entries, p.logprob_offset)
        return shaped

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
