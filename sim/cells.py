"""llama-server's unified KV cache (`-c N`, its default since slots share one context): the
sequences it is processing share one pool of N cells, one per prompt or output token. A
decode step that finds no free cell fails every sequence being processed with an in-band
"Context size has been exceeded." (server-context.cpp, measured on llama-server b1 with
tiny-bytes: a resume of 2,135 prompt tokens and a 2,131-token request beside it, in 4,096
cells, both failed a few tokens in). Idle slots' caches are given up first, so only what
is running counts.

Pure bookkeeping: Run (sim/run.py) takes cells as it prefills and decodes, gives them back
when it ends, and asks before each step whether an overflow failed it."""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass

EXCEEDED = "Context size has been exceeded."


@dataclass(slots=True)
class SharedCells:
    capacity: int
    used: int = 0
    # Bumped by each overflow: a sequence that began in an earlier epoch was being processed
    # when it happened, and failed with it.
    epoch: int = 0

    def take(self, n: int) -> bool:
        """`n` more cells for one sequence; False (an overflow) when they are not free."""
        if self.used + n > self.capacity:
            self.epoch += 1
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)
