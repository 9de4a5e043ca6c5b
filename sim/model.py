"""The toy language model: next-token scores as a pure function of the token history.

The history is folded into a 64-bit rolling hash (one step per token), so the
continuation after ``prompt + generated[:k]`` is identical whether those ids
arrived as a prompt or were generated here — the property token-exact resume
relies on. Candidates come from frequency-weighted tables of ASCII bytes and
merge tokens, so output reads like text (letters, fragments, spaces).

Per-replica "chip" noise: the model marks a fraction ``tie_rate`` of positions
as near-ties (a property of the weights, the same on every replica); at those
positions each chip breaks the tie its own way (one bit from hash(chip_seed,
history)). Two replicas therefore disagree only at near-tie positions, about
half of them, and never at all when tie_rate is 0.

Draft role (``draft_agree_rate`` P < 1): a sim with the same seed acts as a
cheaper draft of the same model. At a fraction 1 - P of positions, chosen by
its own hash of the history (so the same positions on every run, replica and
request), the top two candidates trade places, so the draft's argmax is the
target's runner-up there and the target's argmax everywhere else.

Degenerate mode (``loop_period`` L > 0): once the history has at least
max(``loop_after_len``, L) tokens the argmax is history[-L], so greedy output
falls into a repeated L-gram. Because it reads the history itself, not only its
hash, callers pass the forced token in (``loop=``; see ``loop_index``).

Scores: the candidate at 0-based rank r has logit -r * _RANK_GAP for the first
_MAX_SAMPLE_CANDIDATES ranks; every other id sits at one tail logit, ranked
after them in id order. ``logprob`` is log-softmax of that over the vocabulary.

Byte-level mode (the tokenizer was built with ``byte_level``): the tables
also hold multi-byte pieces, so greedy output mixes ASCII with whole
characters in one token, characters split over several tokens (a lead byte or
fragment, then continuation bytes), and invalid UTF-8 (a lone continuation
byte; a lead byte followed by ASCII). Which table applies depends on a small
UTF-8 state of the history (continuation bytes still owed, and whether the
text so far ends in U+FFFD), kept in the low bits of the history hash; after
a lead byte the next token is usually, not always, a continuation byte.

Reasoning mode (the tokenizer has ``<think>``/``</think>``): the low bits also
count tokens since the last ``<think>`` (saturating at ``think_tokens``); from
``think_tokens`` on, at positions chosen by a hash of the history (and only
where the text so far ends on a whole character), ``</think>`` is forced to
the top, so each think block ends once. Without either mode the hash is the
plain rolling hash, bit for bit as before.

Tool-call mode (the tokenizer has the tool-call tags) leaves the scores alone:
a history whose prompt offers tools (or answers a tool result) gets a plan
(sim.tool_script.ToolCallPlan, a function of the ids) that overrides the
argmax once ``tool_call_after`` tokens are out, at a history
``answer_boundary`` allows.

LoRA adapters (sim.lora): ``with_adapter(identity)`` is the same model whose
history hash starts elsewhere (``identity`` is a digest of the adapter's files),
so its greedy output is another continuation, the same on every replica that
loaded the same files, and resume stays exact under it.

Hashing uses CPython's tuple hash of ints, which is fixed per interpreter
build (no PYTHONHASHSEED involvement): replicas must run the same CPython,
the sim's equivalent of "same engine version".
"""

# baton: pure

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from random import Random

from sim.candidate_tables import (
    TABLE_BITS,
    TABLE_MASK,
    continuation_weights,
    multibyte_weights,
    token_weights,
    utf8_state,
    weighted_table,
)
from sim.tokenizer import EOS, Tokenizer

_MASK64 = (1 << 64) - 1
_EOS_BITS = 16
_TIE_BITS = 24
_SALT_SCORE = -7  # distinct tuple tags so the hashes below are independent
_SALT_CHIP = -11
_SALT_DRAFT = -13
_DRAFT_BITS = 24
_SALT_THINK = -17
_SALT_ADAPTER = -19
# Stateful modes keep this in the low bits of the history hash: bits 0-1 =
# UTF-8 continuation bytes still owed, bit 2 = text so far ends in U+FFFD,
# bits 3.. = 1 + tokens since <think> (saturating), 0 = not thinking.
_UTF8_BITS = 3
_THINK_SHIFT = _UTF8_BITS
MAX_THINK_TOKENS = (1 << 14) - 2
_STATE_MASK = (1 << (_THINK_SHIFT + 14)) - 1
# A quarter of the positions at or past think_tokens end the think block.
_THINK_END_MASK = 3
# Score gap between consecutive candidates, in logits; with temperature T the
# sampling distribution is softmax(-rank * gap / T).
_RANK_GAP = 1.5
_MAX_SAMPLE_CANDIDATES = 20
MAX_RANKED = _MAX_SAMPLE_CANDIDATES  # ranks beyond this are the flat tail
# Tail ids sit well below the last ranked candidate: negligible probability mass,
# so sampling over the ranked candidates alone is the same distribution.
_TAIL_LOGIT = -(MAX_RANKED + 10) * _RANK_GAP


@dataclass(frozen=True, slots=True)
class ModelConfig:
    seed: int = 0
    chip_seed: int = 0
    tie_rate: float = 0.0
    eos_rate: float = 0.0
    draft_agree_rate: float = 1.0  # < 1: act as a draft of the model with this seed
    loop_after_len: int = 0  # degenerate mode: see loop_index
    loop_period: int = 0  # 0 = off
    think_tokens: int = 32  # reasoning mode: </think> comes at or after this many think tokens
    tool_call_after: int = 8  # tool-call mode: the call starts at or after this many tokens
    tool_format: str = "hermes"  # tool-call mode: how calls are written (sim.tool_script)
    parallel_tool_calls: int = 1  # tool-call mode: calls per turn, at most (one per tool)


@dataclass(frozen=True, slots=True)
class Candidates:
    """Top candidates at one position, best first (after chip noise)."""

    ids: tuple[int, ...]
    near_tie: bool


class ToyModel:
    """Deterministic next-token oracle. Holds only immutable precomputed tables."""

    __slots__ = (
        "config", "tokenizer", "_tables", "_tie_cut", "_eos_cut", "_h0", "_space_end",
        "_agree_cut", "_loop_from", "_log_z", "_cont_tables", "_utf8", "_think_start",
        "_think_end", "_think_cap", "start", "advance",
    )
    # Rolling hash of a whole history (equals advancing token by token), and
    # one step of it; plain tuple hashing unless a stateful mode is on.
    start: Callable[[Sequence[int]], int]
    advance: Callable[[int, int], int]

    def __init__(self, config: ModelConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        weights = token_weights(tokenizer)
        if tokenizer.byte_level:
            weights |= multibyte_weights(tokenizer, sum(weights.values()))
        no_space = {t: w for t, w in weights.items() if not tokenizer.pieces[t].startswith(b" ")}
        # After a token ending in a space, never start with one: avoids "  " runs.
        self._tables = (weighted_table(weights), weighted_table(no_space))
        self._space_end = tuple(p.endswith(b" ") for p in tokenizer.pieces)
        # Indexed by continuation bytes owed (byte-level mode only).
        self._cont_tables: tuple[tuple[int, ...], ...] = ()
        if tokenizer.byte_level:
            self._cont_tables = tuple(
                weighted_table(continuation_weights(n)) if n else () for n in range(4)
            )
        self._think_start = tokenizer.think_start
        self._think_end = tokenizer.think_end
        self._think_cap = 1 + min(max(config.think_tokens, 0), MAX_THINK_TOKENS)
        # Per token and UTF-8 state (bits 0-2), the next UTF-8 state.
        self._utf8: tuple[tuple[int, ...], ...] = ()
        if tokenizer.byte_level or self._think_end is not None:
            self._utf8 = tuple(
                tuple(_pack(*utf8_state(p, s & 3, bool(s & 4))) for s in range(8))
                for p in tokenizer.visible
            )
        self._bind()
        self._tie_cut = int(min(max(config.tie_rate, 0.0), 1.0) * (1 << _TIE_BITS))
        self._eos_cut = int(min(max(config.eos_rate, 0.0), 1.0) * (1 << _EOS_BITS))
        self._h0 = hash((config.seed, 0x5EED))
        agree = min(max(config.draft_agree_rate, 0.0), 1.0)
        self._agree_cut = int(agree * (1 << _DRAFT_BITS))
        period = max(config.loop_period, 0)
        self._loop_from = max(config.loop_after_len, period) if period else 0
        ranked = sum(math.exp(-r * _RANK_GAP) for r in range(MAX_RANKED))
        tail = max(tokenizer.vocab_size - MAX_RANKED, 0) * math.exp(_TAIL_LOGIT)
        self._log_z = math.log(ranked + tail)

    def _bind(self) -> None:
        if self._utf8:
            self.start, self.advance = self._start_stateful, self._advance_stateful
        else:
            self.start, self.advance = self._start_plain, _advance_plain

    def with_adapter(self, identity: int) -> ToyModel:
        """This model with a LoRA adapter on top (sim.lora): the same tables, another start
        of the history hash, so another greedy continuation at every history, and still
        the same whether a history came as prompt or was generated (the hash of
        ``prompt + generated[:k]`` folds the same steps from the same start)."""
        other = copy.copy(self)
        other._h0 = hash((self.config.seed, 0x5EED, _SALT_ADAPTER, identity))
        other._bind()  # start and advance are bound methods: rebind them to the copy
        return other

    # -- history hashing -------------------------------------------------
    def _start_plain(self, ids: Sequence[int]) -> int:
        h = self._h0
        for t in ids:
            h = hash((h, t))
        return h

    def _start_stateful(self, ids: Sequence[int]) -> int:
        h, advance = self._h0 & ~_STATE_MASK, self._advance_stateful
        for t in ids:
            h = advance(h, t)
        return h

    def _advance_stateful(self, h: int, token_id: int) -> int:
        utf8 = self._utf8[token_id][h & 7]
        think = (h & _STATE_MASK) >> _THINK_SHIFT
        if token_id == self._think_start:
            think = 1
        elif token_id == self._think_end:
            think = 0
        elif think and think < self._think_cap:
            think += 1
        return (hash((h, token_id)) & ~_STATE_MASK) | (think << _THINK_SHIFT) | utf8

    # -- scores ------------------------------------------------------------
    def _table_for(self, h: int, last: int | None) -> tuple[int, ...]:
        if self._cont_tables and h & 3:
            return self._cont_tables[h & 3]
        if last is not None and self._space_end[last]:
            return self._tables[1]
        return self._tables[0]

    def _ends_think(self, h: int) -> bool:
        """Reasoning mode: whether </think> is forced to the top at this history."""
        return (
            self._think_end is not None
            and (h & _STATE_MASK) >> _THINK_SHIFT == self._think_cap
            and not h & 7  # the text so far ends on a whole character
            and not hash((h, _SALT_THINK)) & _THINK_END_MASK
        )

    def answer_boundary(self, h: int) -> bool:
        """Whether the text so far ends on a whole character, outside a think block.

        Where a tool call may start (sim.tools). Without a stateful mode the
        output is ASCII and there are no think blocks: always.
        """
        return not self._utf8 or not h & _STATE_MASK

    def near_tie(self, h: int) -> bool:
        """Whether the top-2 margin at this history is within chip noise (model property)."""
        x = hash((h, _SALT_SCORE)) & _MASK64
        return (x >> 40) < self._tie_cut

    @property
    def is_draft(self) -> bool:
        return self._agree_cut < (1 << _DRAFT_BITS)

    def draft_disagrees(self, h: int) -> bool:
        """Whether this (draft) model's top two are swapped at this history."""
        y = hash((h, _SALT_DRAFT)) & _MASK64
        return (y >> 40) >= self._agree_cut

    @property
    def loops(self) -> bool:
        return self._loop_from > 0

    def loop_index(self, history_len: int) -> int | None:
        """Index into the history of the forced (looping) token, or None when not looping."""
        if self._loop_from and history_len >= self._loop_from:
            return history_len - self.config.loop_period
        return None

    def loop_token(self, history: Sequence[int]) -> int | None:
        i = self.loop_index(len(history))
        return None if i is None else history[i]

    def logprob(self, rank: int) -> float:
        """Log-probability (temperature 1) of the candidate at 1-based ``rank``."""
        logit = -(rank - 1) * _RANK_GAP if rank <= MAX_RANKED else _TAIL_LOGIT
        return logit - self._log_z

    def candidates(
        self, h: int, last: int | None, k: int = 2, *, allow_eos: bool = True,
        loop: int | None = None,
    ) -> Candidates:
        """Best k candidate ids at history hash ``h`` (``last`` = last token of the history).

        ``loop`` is the token degenerate mode forces to the top (from loop_index).
        The list for a smaller k is always a prefix of the list for a larger one.
        """
        x = hash((h, _SALT_SCORE)) & _MASK64
        table = self._table_for(h, last)
        top1 = table[x & TABLE_MASK]
        slot = (x >> TABLE_BITS) & TABLE_MASK
        top2 = table[slot]
        while top2 == top1:
            slot = (slot + 1) & TABLE_MASK
            top2 = table[slot]
        tie = (x >> 40) < self._tie_cut
        if tie and hash((h, _SALT_CHIP, self.config.chip_seed)) & 1:
            top1, top2 = top2, top1
        ids = [top1, top2]
        seed = x
        while len(ids) < k:
            seed = hash((seed, len(ids)))
            cand = table[seed & TABLE_MASK]
            if cand not in ids:
                ids.append(cand)
        if allow_eos and ((x >> 24) & 0xFFFF) < self._eos_cut:
            ids.insert(0, EOS)
        n = max(k, 2)
        del ids[n:]
        if self.is_draft and self.draft_disagrees(h):
            ids[0], ids[1] = ids[1], ids[0]
        if self._think_end is not None and self._ends_think(h):
            end = self._think_end
            ids = [end, *(t for t in ids if t != end)][:n]
        if loop is not None and _forced(loop, allow_eos):
            ids = [loop, *(t for t in ids if t != loop)][:n]
        return Candidates(tuple(ids), tie)

    def greedy(
        self, h: int, last: int | None, *, allow_eos: bool = True, loop: int | None = None
    ) -> int:
        """Argmax; the same answer as ``candidates(...).ids[0]``, without allocations."""
        if loop is not None and _forced(loop, allow_eos):
            return loop
        if self._think_end is not None and self._ends_think(h):
            return self._think_end
        if self.is_draft:
            # Drafts are the rarer, cheaper role: reuse candidates() rather than
            # duplicate the swap logic in this fast path.
            return self.candidates(h, last, 2, allow_eos=allow_eos).ids[0]
        x = hash((h, _SALT_SCORE)) & _MASK64
        if allow_eos and ((x >> 24) & 0xFFFF) < self._eos_cut:
            return EOS
        table = self._table_for(h, last)
        top1 = table[x & TABLE_MASK]
        if (x >> 40) < self._tie_cut and hash((h, _SALT_CHIP, self.config.chip_seed)) & 1:
            slot = (x >> TABLE_BITS) & TABLE_MASK
            top2 = table[slot]
            while top2 == top1:
                slot = (slot + 1) & TABLE_MASK
                top2 = table[slot]
            return top2
        return top1

    def sample(
        self,
        h: int,
        last: int | None,
        rng: Random,
        *,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        allow_eos: bool = True,
        loop: int | None = None,
    ) -> int:
        """Sample from softmax(-rank * gap / T) over the best candidates, top-k/top-p cut."""
        k = _MAX_SAMPLE_CANDIDATES if top_k <= 0 else min(top_k, _MAX_SAMPLE_CANDIDATES)
        ids = self.candidates(h, last, max(k, 2), allow_eos=allow_eos, loop=loop).ids[:k]
        weights = [math.exp(-r * _RANK_GAP / temperature) for r in range(len(ids))]
        total = sum(weights)
        kept, acc = 0, 0.0
        for w in weights:  # smallest prefix reaching top_p (always at least one)
            kept += 1
            acc += w / total
            if acc >= top_p:
                break
        u = rng.random() * sum(weights[:kept])
        for tok, w in zip(ids[:kept], weights[:kept], strict=True):
            u -= w
            if u <= 0:
                return tok
        return ids[kept - 1]


def _advance_plain(h: int, token_id: int) -> int:
    return hash((h, token_id))


def _pack(owed: int, bad: bool) -> int:
    return owed | (4 if bad else 0)


def _forced(loop: int, allow_eos: bool) -> bool:
    # A loop onto EOS while EOS is suppressed (min_tokens, ignore_eos) falls back
    # to the ordinary scores rather than emitting a token the request forbade.
    return allow_eos or loop != EOS
