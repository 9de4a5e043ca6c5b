"""Sampled-token logprobs as vLLM 0.32 reports them, in each API's shape (pure).

The engine side (vLLM's sampler and v1/engine/logprobs.py): at each generated
position the logprobs come from the raw logits (before min_tokens, ignore_eos
and allowed_token_ids masks), as a dict in this order: the sampled token with
its own rank, then ranks 1..k (a sampled token among them keeps its first
place). Here the raw ranking is ``Sequence.ranking()`` (a tool-call script's
token is put first: the model is sure of its call) and a rank's logprob is
``ToyModel.logprob(rank)``. Each candidate's decoded token is
``tokenizer.decode([id])`` (special tokens spelled out); one that ends in
U+FFFD is corrected from up to 4 previously *sampled* tokens of this request
(never the prompt's): the first context length whose decode no longer ends in
U+FFFD wins, and the text after the context's clean prefix is the token's; no
such length gives "". So the byte that completes a split character carries the
whole character and the bytes before it "" -- and a request whose first token
completes a character from its prompt gives "" there (what a resume over
/inference/v1/generate shows at such a cut).

The API shapes (vLLM's serving code), per chunk over that chunk's tokens:

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``,
  top_logprobs the dict's first ``top_logprobs`` entries (0: none);
* completions: ``{"text_offset", "token_logprobs", "tokens", "top_logprobs":
  [{token: logprob}]}``, each dict the first k + 1 entries keyed by decoded
  token (a later equal key overwrites), text_offset running over the decoded
  tokens' lengths across the choice's chunks;
* /inference/v1/generate text mode: chat's shape, top_logprobs the first
  max(k, 1) entries; tokens mode: ``{"content": [{"token_id", "logprob",
  "rank", "top_logprobs": [{"token_id", "logprob", "rank"}]}]}``, the same
  entries with integer ids and ranks.

Logprobs are float32 values (vLLM's tensors), clamped at -9999.0 as vLLM does (never
reached by the toy model).
"""

# baton: pure

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sim.generation import Sequence as Seq
from sim.generation import TokenEvent
from sim.model import ToyModel
from sim.scoring import tail_rank
from sim.tokenizer import Tokenizer

Style = Literal["chat", "completion", "text", "tokens"]
FLOOR = -9999.0
CONTEXT = 4  # sampled tokens vLLM looks back over to correct a split character
_FFFD = "\ufffd"


@dataclass(frozen=True, slots=True)
class Candidate:
    token_id: int
    logprob: float
    rank: int
    token: str  # decoded, corrected


@dataclass(frozen=True, slots=True)
class Position:
    """One generated token and the engine's candidate dict there, in its order."""

    token_id: int
    candidates: tuple[Candidate, ...]  # the sampled token first

    @property
    def sampled(self) -> Candidate:
        return self.candidates[0]


def decoded_token(tok: Tokenizer, token_id: int, context: Sequence[int]) -> str:
    """vLLM's decoded token for a candidate after the sampled ``context`` (oldest first)."""
    text = tok.texts[token_id]
    if not text.endswith(_FFFD):
        return text
    ctx_all = list(context[-CONTEXT:])
    for n in range(1, len(ctx_all) + 1):
        ctx = ctx_all[-n:]
        full = tok.decode([*ctx, token_id])
        if full.endswith(_FFFD):
            continue
        # Context tokens that were themselves partial gave "" when they came: their
        # bytes belong to this token's text, so only the clean prefix is cut off.
        clean = len(ctx)
        while clean > 0 and tok.texts[ctx[clean - 1]].endswith(_FFFD):
            clean -= 1
        prefix = tok.decode(ctx[:clean]) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def position(
    model: ToyModel, ranking: Sequence[int], token_id: int, k: int, context: Sequence[int],
    *, forced: bool = False,
) -> Position:
    """The candidate dict at one position: the sampled token, then ranks 1..k."""
    if forced:  # the script's token is the model's certain pick
        ranking = [token_id, *(t for t in ranking if t != token_id)]
    if token_id in ranking:
        rank = list(ranking).index(token_id) + 1
    else:
        rank = tail_rank(ranking, token_id)
    tok = model.tokenizer
    out: dict[int, Candidate] = {}
    for tid, r in ((token_id, rank), *((t, i) for i, t in enumerate(ranking[:k], start=1))):
        # A repeated id keeps its first place and takes the later value, as a dict does.
        out[tid] = Candidate(tid, _f32(model.logprob(r)), r, decoded_token(tok, tid, context))
    return Position(token_id, tuple(out.values()))


def _f32(x: float) -> float:
    """As the engine's float32 logprob tensor holds it (then as a Python float)."""
    value: float = struct.unpack("f", struct.pack("f", x))[0]
    return max(value, FLOOR)


class ChoiceLogprobs:
    """One choice's logprobs: positions as they are generated, formatted per chunk."""

    __slots__ = ("_model", "_style", "_k", "_context", "_pending", "_offset")

    def __init__(self, model: ToyModel, style: Style, k: int) -> None:
        self._model = model
        self._style = style
        self._k = k
        self._context: list[int] = []  # the last sampled ids (vLLM's correction context)
        self._pending: list[Position] = []
        self._offset = 0  # completions: text_offset of the next token

    def add(self, ranking: Sequence[int], token_id: int, *, forced: bool = False) -> None:
        self._pending.append(
            position(self._model, ranking, token_id, self._k, self._context, forced=forced)
        )
        self._context = [*self._context[-(CONTEXT - 1):], token_id]

    def take(self, *, drop: bool = False) -> dict[str, Any]:
        """The logprobs object for the tokens added since the last take (``drop``: for a
        chunk with no tokens, as an abort's, whatever is pending is forgotten)."""
        positions = [] if drop else self._pending
        self._pending = []
        if self._style == "completion":
            body, self._offset = completion_logprobs(positions, self._k, self._offset)
            return body
        if self._style == "tokens":
            return tokens_logprobs(positions, max(self._k, 1))
        return chat_logprobs(positions, self._k if self._style == "chat" else max(self._k, 1))


class RunLogprobs:
    """Every choice's logprobs in one run (sim.run): each step scored where it is sampled."""

    __slots__ = ("_choices", "_hidden")

    def __init__(self, model: ToyModel, style: Style, k: int, n: int, *, hidden: bool) -> None:
        self._choices = [ChoiceLogprobs(model, style, k) for _ in range(n)]
        self._hidden = hidden  # computed, never sent

    def step(self, i: int, seq: Seq) -> TokenEvent:
        ranking = seq.ranking()  # before the step: the position the token is sampled at
        ev = seq.step()
        self._choices[i].add(ranking, ev.token_id, forced=seq.forced)
        return ev

    def take(self, i: int, *, drop: bool = False) -> dict[str, Any] | None:
        body = self._choices[i].take(drop=drop)
        return None if self._hidden else body


def _entry(c: Candidate) -> dict[str, Any]:
    return {"token": c.token, "logprob": c.logprob, "bytes": list(c.token.encode())}


def chat_logprobs(positions: Sequence[Position], top: int) -> dict[str, Any]:
    """Chat's (and generate text mode's) shape; ``top`` dict entries per token."""
    return {
        "content": [
            {**_entry(p.sampled), "top_logprobs": [_entry(c) for c in p.candidates[:top]]}
            for p in positions
        ]
    }


def tokens_logprobs(positions: Sequence[Position], top: int) -> dict[str, Any]:
    """Generate tokens mode: integer ids and ranks, no tokenizer."""

    def one(c: Candidate) -> dict[str, Any]:
        return {"token_id": c.token_id, "logprob": c.logprob, "rank": c.rank}

    return {
        "content": [
            {**one(p.sampled), "top_logprobs": [one(c) for c in p.candidates[:top]]}
            for p in positions
        ]
    }


def completion_logprobs(
    positions: Sequence[Position], k: int, offset: int
) -> tuple[dict[str, Any], int]:
    """Completions' shape and the text_offset the choice's next chunk starts at."""
    offsets: list[int] = []
    for p in positions:
        offsets.append(offset)
        offset += len(p.sampled.token)
    body = {
        "text_offset": offsets,
        "token_logprobs": [p.sampled.logprob for p in positions],
        "tokens": [p.sampled.token for p in positions],
        "top_logprobs": [{c.token: c.logprob for c in p.candidates[: k + 1]} for p in positions],
    }
    return body, offset
