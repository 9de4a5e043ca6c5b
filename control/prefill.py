"""What a backend's time to first token costs, learned from the outcomes shims report: the
milliseconds per uncached prompt token (prefill) and per request already queued on it
(each one ahead takes its turn at the engine first). Each route's prediction is kept until its
outcome arrives; the error between them moves the two rates (an exponentially weighted
average per backend, bounded to sane values), so a slow card, a busy card or a card with a
longer context shows up in the estimates within a few requests.

Pure: the router feeds it; policies read `rates()`."""

# baton: pure

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Before a backend has reported anything: a plausible GPU (prefill ~20k tokens/s, a queued
# request costing about one short prefill). Both are learned away within a few outcomes.
DEFAULT_MS_PER_TOKEN = 0.05
DEFAULT_MS_PER_QUEUED = 20.0
ALPHA = 0.2  # weight of the newest observation
# A TTFT is also a fixed overhead (scheduling, the first decode step, the network): over a
# handful of tokens it would read as an absurd per-token rate. Only prompts with at least this
# many uncached tokens teach the prefill rate.
MIN_TOKENS_TO_LEARN = 128
BOUNDS_PER_TOKEN = (1e-4, 50.0)
BOUNDS_PER_QUEUED = (0.0, 60_000.0)


@dataclass(frozen=True, slots=True)
class Rates:
    ms_per_token: float = DEFAULT_MS_PER_TOKEN
    ms_per_queued: float = DEFAULT_MS_PER_QUEUED

    def ttft_ms(self, uncached_tokens: float, queue: float) -> float:
        return queue * self.ms_per_queued + uncached_tokens * self.ms_per_token


@dataclass(frozen=True, slots=True)
class Predicted:
    backend_id: str
    uncached_tokens: float
    queue: float
    prompt_chars: int = 0


# A prompt's characters per token before any report says otherwise (English text, BPE).
DEFAULT_CHARS_PER_TOKEN = 4.0


def _clip(v: float, bounds: tuple[float, float]) -> float:
    return min(max(v, bounds[0]), bounds[1])


class PrefillRates:
    def __init__(self, pending_capacity: int = 100_000) -> None:
        self._rates: dict[str, Rates] = {}
        self._pending: OrderedDict[str, Predicted] = OrderedDict()
        self._capacity = pending_capacity
        # Learned from the prompt sizes shims report (a model's tokenizer, the fleet's text).
        self.chars_per_token = DEFAULT_CHARS_PER_TOKEN

    def rates(self, backend_id: str) -> Rates:
        return self._rates.get(backend_id, Rates())

    def predicted(self, request_id: str, prediction: Predicted) -> None:
        self._pending[request_id] = prediction
        while len(self._pending) > self._capacity:
            self._pending.popitem(last=False)

    def observed(
        self, request_id: str, backend_id: str, ttft_ms: float, prompt_tokens: int = 0
    ) -> None:
        """The request's real TTFT. A request ahead in the queue holds the engine about as
        long as a typical request's own first token takes there, so the per-queued rate
        follows the TTFTs themselves; the per-token rate takes what the queue does not
        explain, over the uncached tokens. (Splitting the error in proportion instead left
        the queue rate at its prior whenever routes saw empty queues, and the policy piled
        requests onto a cached card.) A request served elsewhere than predicted (a retry)
        teaches nothing."""
        p = self._pending.pop(request_id, None)
        if p is None or p.backend_id != backend_id or ttft_ms <= 0:
            return
        if p.prompt_chars and prompt_tokens >= MIN_TOKENS_TO_LEARN:
            ratio = p.prompt_chars / prompt_tokens
            self.chars_per_token = (1 - ALPHA) * self.chars_per_token + ALPHA * ratio
        old = self.rates(backend_id)
        # The request's own service time: what waiting behind the queue does not explain. A
        # request ahead holds the engine about that long (its whole TTFT would count the
        # waits it had itself, and feed back into more waiting).
        own = max(ttft_ms - p.queue * old.ms_per_queued, 0.0)
        per_queued = (1 - ALPHA) * old.ms_per_queued + ALPHA * own
        per_token = old.ms_per_token
        if p.uncached_tokens >= MIN_TOKENS_TO_LEARN:
            per_token = (1 - ALPHA) * per_token + ALPHA * own / p.uncached_tokens
        self._rates[backend_id] = Rates(
            _clip(per_token, BOUNDS_PER_TOKEN), _clip(per_queued, BOUNDS_PER_QUEUED)
        )
