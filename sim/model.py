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

Hashing uses CPython's tuple hash of ints, which is fixed per interpreter
build (no PYTHONHASHSEED involvement): replicas must run the same CPython,
the sim's equivalent of "same engine version".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from random import Random

from sim.tokenizer import EOS, FIRST_MERGE_ID, Tokenizer

_MASK64 = (1 << 64) - 1
_TABLE_BITS = 12
_TABLE_SIZE = 1 << _TABLE_BITS
_TABLE_MASK = _TABLE_SIZE - 1
_EOS_BITS = 16
_TIE_BITS = 24
_SALT_SCORE = -7  # distinct tuple tags so the hashes below are independent
_SALT_CHIP = -11
_SALT_DRAFT = -13
_DRAFT_BITS = 24
# Score gap between consecutive candidates, in logits; with temperature T the
# sampling distribution is softmax(-rank * gap / T).
_RANK_GAP = 1.5
_MAX_SAMPLE_CANDIDATES = 20
MAX_RANKED = _MAX_SAMPLE_CANDIDATES  # ranks beyond this are the flat tail
# Tail ids sit well below the last ranked candidate: negligible probability mass,
# so sampling over the ranked candidates alone is the same distribution.
_TAIL_LOGIT = -(MAX_RANKED + 10) * _RANK_GAP

# Rough English letter frequencies (per mille) to make output look like text.
_LETTER_WEIGHTS = {
    "e": 127, "t": 91, "a": 82, "o": 75, "i": 70, "n": 67, "s": 63, "h": 61,
    "r": 60, "d": 43, "l": 40, "c": 28, "u": 28, "m": 24, "w": 24, "f": 22,
    "g": 20, "y": 20, "p": 19, "b": 15, "v": 10, "k": 8, "j": 2, "x": 2, "q": 1,
    "z": 1,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    seed: int = 0
    chip_seed: int = 0
    tie_rate: float = 0.0
    eos_rate: float = 0.0
    draft_agree_rate: float = 1.0  # < 1: act as a draft of the model with this seed
    loop_after_len: int = 0  # degenerate mode: see loop_index
    loop_period: int = 0  # 0 = off


@dataclass(frozen=True, slots=True)
class Candidates:
    """Top candidates at one position, best first (after chip noise)."""

    ids: tuple[int, ...]
    near_tie: bool


def _weighted_table(weights: dict[int, float]) -> tuple[int, ...]:
    """Spread ids over _TABLE_SIZE slots proportionally to weight (deterministic)."""
    total = sum(weights.values())
    table: list[int] = []
    for tok, w in sorted(weights.items()):
        table.extend([tok] * max(1, round(w / total * _TABLE_SIZE)))
    while len(table) < _TABLE_SIZE:  # rounding may leave it short: wrap around
        table.extend(table[: _TABLE_SIZE - len(table)])
    table = table[:_TABLE_SIZE]
    # Scatter with an odd multiplier (a permutation mod 2^k) so that the top-1
    # and top-2 slots, read from different hash bits, are unrelated.
    return tuple(table[(i * 2654435761) % _TABLE_SIZE] for i in range(_TABLE_SIZE))


def _token_weights(tok: Tokenizer) -> dict[int, float]:
    weights: dict[int, float] = {}
    for ch, w in _LETTER_WEIGHTS.items():
        weights[ord(ch)] = float(w)
        weights[ord(ch.upper())] = w / 25
    weights[ord(" ")] = 260.0
    for ch in ",.'?!-":
        weights[ord(ch)] = 6.0
    for d in "0123456789":
        weights[ord(d)] = 1.0
    for i in range(FIRST_MERGE_ID, tok.vocab_size):
        text = tok.texts[i]
        if text.strip():  # skip pure-whitespace merges: they only make gaps
            weights[i] = 12.0 if text.startswith(" ") else 9.0
    return weights


class ToyModel:
    """Deterministic next-token oracle. Holds only immutable precomputed tables."""

    __slots__ = (
        "config", "tokenizer", "_tables", "_tie_cut", "_eos_cut", "_h0", "_space_end",
        "_agree_cut", "_loop_from", "_log_z",
    )

    def __init__(self, config: ModelConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        weights = _token_weights(tokenizer)
        no_space = {t: w for t, w in weights.items() if not tokenizer.texts[t].startswith(" ")}
        # After a token ending in a space, never start with one: avoids "  " runs.
        self._tables = (_weighted_table(weights), _weighted_table(no_space))
        self._space_end = tuple(t.endswith(" ") for t in tokenizer.texts)
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

    # -- history hashing -------------------------------------------------
    def start(self, ids: Sequence[int]) -> int:
        """Rolling hash of a whole history (equals advancing token by token)."""
        h = self._h0
        for t in ids:
            h = hash((h, t))
        return h

    @staticmethod
    def advance(h: int, token_id: int) -> int:
        return hash((h, token_id))

    # -- scores ------------------------------------------------------------
    def _table_for(self, last: int | None) -> tuple[int, ...]:
        if last is not None and self._space_end[last]:
            return self._tables[1]
        return self._tables[0]

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
        table = self._table_for(last)
        top1 = table[x & _TABLE_MASK]
        slot = (x >> _TABLE_BITS) & _TABLE_MASK
        top2 = table[slot]
        while top2 == top1:
            slot = (slot + 1) & _TABLE_MASK
            top2 = table[slot]
        tie = (x >> 40) < self._tie_cut
        if tie and hash((h, _SALT_CHIP, self.config.chip_seed)) & 1:
            top1, top2 = top2, top1
        ids = [top1, top2]
        seed = x
        while len(ids) < k:
            seed = hash((seed, len(ids)))
            cand = table[seed & _TABLE_MASK]
            if cand not in ids:
                ids.append(cand)
        if allow_eos and ((x >> 24) & 0xFFFF) < self._eos_cut:
            ids.insert(0, EOS)
        n = max(k, 2)
        del ids[n:]
        if self.is_draft and self.draft_disagrees(h):
            ids[0], ids[1] = ids[1], ids[0]
        if loop is not None and _forced(loop, allow_eos):
            ids = [loop, *(t for t in ids if t != loop)][:n]
        return Candidates(tuple(ids), tie)

    def greedy(
        self, h: int, last: int | None, *, allow_eos: bool = True, loop: int | None = None
    ) -> int:
        """Argmax; the same answer as ``candidates(...).ids[0]``, without allocations."""
        if loop is not None and _forced(loop, allow_eos):
            return loop
        if self.is_draft:
            # Drafts are the rarer, cheaper role: reuse candidates() rather than
            # duplicate the swap logic in this fast path.
            return self.candidates(h, last, 2, allow_eos=allow_eos).ids[0]
        x = hash((h, _SALT_SCORE)) & _MASK64
        if allow_eos and ((x >> 24) & 0xFFFF) < self._eos_cut:
            return EOS
        table = self._table_for(last)
        top1 = table[x & _TABLE_MASK]
        if (x >> 40) < self._tie_cut and hash((h, _SALT_CHIP, self.config.chip_seed)) & 1:
            slot = (x >> _TABLE_BITS) & _TABLE_MASK
            top2 = table[slot]
            while top2 == top1:
                slot = (slot + 1) & _TABLE_MASK
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


def _forced(loop: int, allow_eos: bool) -> bool:
    # A loop onto EOS while EOS is suppressed (min_tokens, ignore_eos) falls back
    # to the ordinary scores rather than emitting a token the request forbade.
    return allow_eos or loop != EOS
