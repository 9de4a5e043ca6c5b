"""vLLM-style ``prompt_logprobs``: the model's scores at every prompt position (pure).

Entry j (j >= 1) scores prompt[j] given prompt[:j]; entry 0 is None (nothing
precedes the first token), as in vLLM. Each entry maps token id -> (logprob,
rank) for the top-k candidates (ranks 1..k) plus the actual prompt token,
whatever its rank. Rank 1 is exactly what greedy generation would emit after
prompt[:j] on this replica (chip noise, draft swap and loop included, EOS
allowed as for a request with default min_tokens), which is what lets a router
verify draft tokens with one scoring call.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sim.model import MAX_RANKED, ToyModel


@dataclass(frozen=True, slots=True)
class Scored:
    token_id: int
    logprob: float
    rank: int  # 1 = argmax


def prompt_logprobs(
    model: ToyModel, prompt: Sequence[int], k: int
) -> list[tuple[Scored, ...] | None]:
    """Per position: the top-k candidates best first, then the actual token if not among them."""
    out: list[tuple[Scored, ...] | None] = [None]
    h = model.start(prompt[:1])
    for j in range(1, len(prompt)):
        out.append(_score_position(model, h, prompt, j, k))
        h = model.advance(h, prompt[j])
    return out


def _score_position(
    model: ToyModel, h: int, prompt: Sequence[int], j: int, k: int
) -> tuple[Scored, ...]:
    last, actual = prompt[j - 1], prompt[j]
    i = model.loop_index(j)
    loop = None if i is None else prompt[i]
    # Candidate lists are prefix-consistent, so rank k+1 only costs more work
    # when the actual token is not in the top k.
    ids = model.candidates(h, last, max(k, 1), loop=loop).ids[:k]
    rank = _rank_in(ids, actual)
    if rank is None:
        ranked = model.candidates(h, last, MAX_RANKED, loop=loop).ids
        rank = _rank_in(ranked, actual)
        if rank is None:
            rank = tail_rank(ranked, actual)
    scored = [Scored(t, model.logprob(r), r) for r, t in enumerate(ids, start=1)]
    if rank > k:
        scored.append(Scored(actual, model.logprob(rank), rank))
    return tuple(scored)


def _rank_in(ids: Sequence[int], token: int) -> int | None:
    try:
        return ids.index(token) + 1
    except ValueError:
        return None


def tail_rank(ranked: Sequence[int], token: int) -> int:
    """Rank of an id outside the ranked candidates: after them, in id order."""
    return len(ranked) + 1 + token - sum(1 for t in ranked if t < token)
