"""A run of plain token chunks, tracked and relayed as one: most of a stream.

A plain chunk is what `Stitcher._plain` takes one at a time: one choice (index 0), its text
(a chat delta's `content` and nothing else, or a completion's `text`) and one or more token
ids, no finish, no logprobs, no prompt ids. A read of a fast engine carries dozens of them.
Split, parsed and stripped one by one, each costs ~9 Python calls; here a run of n costs a
few C calls whatever n is: one msgspec decode of the events' data as one JSON array, one
strip of the ids from the run's bytes, and one append of its text and ids to the stream's
progress (ChoiceProgress.add_run). Anything else in the run (a role, a finish, a tool call,
a field of the wrong type, a token id out of range, garbage) fails the typed decode, and the
caller offers the run's events one by one to the general path, which judges them exactly as
before: this is only a faster way to the same bytes and the same progress."""

# baton: pure

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from dataplane.upstream.chunks import TokenId

# What the client does not get of a plain chunk: the ids Baton asked for. Compact JSON as the
# engines write it (a space makes the check below fail, and the general path strips it).
_IDS = re.compile(rb',"token_ids":\[[\d,]*\]')
_SEP = b"\n\ndata: "
Ids = Annotated[list[TokenId], msgspec.Meta(min_length=1)]


class _Content(msgspec.Struct, forbid_unknown_fields=True):
    content: str  # a delta of text alone (a role, reasoning, tool calls: not plain)


class _ChatChoice(msgspec.Struct):
    delta: _Content
    token_ids: Ids
    index: Literal[0] = 0
    finish_reason: None = None
    logprobs: None = None
    prompt_token_ids: None = None
    text: None = None  # (typed as parse_chunk types it: present, it must be null)


class _TextChoice(msgspec.Struct):
    token_ids: Ids
    text: str | None = None
    index: Literal[0] = 0
    finish_reason: None = None
    logprobs: None = None
    prompt_token_ids: None = None
    delta: None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0  # parse_chunk's one check of a chunk's usage


class _Chat(msgspec.Struct):
    choices: tuple[_ChatChoice]
    system_fingerprint: Any = None
    prompt_token_ids: None = None
    usage: _Usage | None = None


class _Text(msgspec.Struct):
    choices: tuple[_TextChoice]
    system_fingerprint: Any = None
    prompt_token_ids: None = None
    usage: _Usage | None = None


_chat = msgspec.json.Decoder(list[_Chat])
_text = msgspec.json.Decoder(list[_Text])


def looks_plain(raw: bytes) -> bool:
    """A cheap guess, on an event's bytes (its blank line cut off), that it is a plain chunk:
    where a run may end. A wrong guess costs only speed: plain_run decides."""
    return b'"finish_reason":null' in raw


class Run(msgspec.Struct):
    texts: list[str]
    ids: list[list[int]]
    fingerprint: Any  # the last one a chunk of the run carried, or None
    client: bytes  # the run as the client gets it: the engine's bytes less the ids


def decode(run: bytes, n: int, chat: bool) -> Run | None:
    """`run`: n whole events, each ending in its blank line. None unless every one is a
    one-line `data: ` event carrying a plain chunk whose ids cut out as bytes."""
    if (
        not run.startswith(b"data: ")
        or run.count(b"\n") != 2 * n  # one line each: no field but data
        or run.count(_SEP) != n - 1  # ...and each line is `data: `
    ):
        return None
    client = _IDS.sub(b"", run)
    if b"token_ids" in client:
        return None
    body = b"[" + run[6:-2].replace(_SEP, b",") + b"]"
    fingerprint = None
    try:
        if chat:
            chat_chunks = _chat.decode(body)
            choices: list[Any] = [c.choices[0] for c in chat_chunks]
            texts = [ch.delta.content for ch in choices]
            chunks: list[Any] = chat_chunks
        else:
            text_chunks = _text.decode(body)
            choices = [c.choices[0] for c in text_chunks]
            texts = [ch.text or "" for ch in choices]
            chunks = text_chunks
    except msgspec.DecodeError:  # a ValidationError is one
        return None
    if b'"system_fingerprint"' in run:
        for c in chunks:
            fingerprint = c.system_fingerprint or fingerprint
    return Run(texts, [ch.token_ids for ch in choices], fingerprint, client)
