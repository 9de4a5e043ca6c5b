"""llama-server's unified KV cache (`-c N`, its default since slots share one context): the
sequences it is processing share one pool of N cells, one per prompt or output token. A
decode step that finds no free cell fails every sequence being processed with an in-band
"Context size has been exceeded." (server-context.cpp). Measured on the llama-server
`make engines` builds, tiny-bytes, `-c 4096`: a resume of a 2,135-token prompt and a
non-streamed request with nearly the same prompt beside it both failed, holding 2,142 and
2,047 cells. Requests one after another never did (a finished request's cells are taken
back), so only what is running counts.

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
