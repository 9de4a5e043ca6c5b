"""Speculative-decoding counters for a sim posing as a target with a draft (pure).

The toy model's output does not change (speculative decoding is lossless);
only vLLM's acceptance counters move, so control's pair-acceptance telemetry
has something real to read. Each step proposes ``num_tokens`` drafts; drafts
are accepted left to right, each with probability ``acceptance``, until the
first rejection (as in rejection sampling), and the step yields accepted + 1
tokens.
"""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass
from random import Random


@dataclass(frozen=True, slots=True)
class SpecConfig:
    num_tokens: int = 0  # 0 = no speculative decoding
    acceptance: float = 0.7

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


@dataclass(frozen=True, slots=True)
class SpecCounts:
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: tuple[int, ...]


def count(cfg: SpecConfig, generated: int, rng: Random) -> SpecCounts:
    """Counters for ``generated`` output tokens."""
    per_pos = [0] * cfg.num_tokens
    drafts = accepted = produced = 0
    while produced < generated:
        drafts += 1
        step_accepted = 0
        for pos in range(cfg.num_tokens):
            if rng.random() >= cfg.acceptance:
                break
            per_pos[pos] += 1
            step_accepted += 1
        accepted += step_accepted
        produced += step_accepted + 1
    return SpecCounts(drafts, drafts * cfg.num_tokens, accepted, tuple(per_pos))
