"""What a backend's time to first token costs, learned from the outcomes shims report.

A new request's first token waits for the prefill work already ahead of it on that engine,
then for its own prefill. Three terms, per backend:

- Baton's own backlog: the uncached prompt tokens Baton sent there and predicts are still
  to be prefilled, drained at the backend's prefill rate (an engine prefills one batch at
  a time: work ahead is done before, or beside, a new request's). A count of requests
  ahead would weigh a 4,000-token prompt like a 100-token one.
- Requests Baton did not send (the engine's own running + waiting count beyond Baton's),
  whose size nobody knows: each costs `ms_per_outside`, learned.
- The request's own uncached prompt tokens; these and the backlog's cost `ms_per_token`,
  learned. (One rate for both: learning the rate from the TTFT while the backlog's cost
  came from that same rate, separately, fed each error back into the next backlog and the
  estimates swung the whole fleet's conversations from card to card.)

Each route's prediction is kept until its outcome arrives; the error between them moves the
two rates (an exponentially weighted step, split between the terms in proportion to what
each predicted, bounded to sane values), so a slow card or a card busy with someone else's
work shows up in the estimates within a few requests.

Also learned: a prompt's characters per token, per model (its tokenizer on the fleet's
text: a byte-level model makes 1, an English BPE one about 4), for prompts whose token
count no shim has reported yet.

Pure: the router feeds it, with its clock; policies read `rates()` and `backlog_ms()`."""

# baton: pure

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from baton.model import CHARS_PER_TOKEN

# Before a backend has reported anything: a plausible GPU (prefill ~20k tokens/s, a request
# of unknown size costing about one short prefill). Both are learned away within a few
# outcomes.
DEFAULT_MS_PER_TOKEN = 0.05
DEFAULT_MS_PER_OUTSIDE = 20.0
ALPHA = 0.2  # weight of the newest observation
# A TTFT is also a fixed overhead (scheduling, the first decode step, the network): over a
# handful of tokens it would read as an absurd per-token rate. Only prompts with at least this
# many uncached tokens teach the prefill rate.
MIN_TOKENS_TO_LEARN = 128
BOUNDS_PER_TOKEN = (1e-4, 50.0)
BOUNDS_PER_OUTSIDE = (0.0, 60_000.0)
# Characters per token is a ratio of sums over recent prompts: the first report replaces
# the guess at once (a byte-level tokenizer makes 1, not 4: an estimate off by 4x credits a
# continuation with its whole prompt cached), and older prompts fade by this much per report.
SIZE_MEMORY = 0.98


@dataclass(frozen=True, slots=True)
class Rates:
    ms_per_token: float = DEFAULT_MS_PER_TOKEN
    ms_per_outside: float = DEFAULT_MS_PER_OUTSIDE

    def ttft_ms(
        self, uncached_tokens: float, backlog_ms: float = 0.0, outside: float = 0.0
    ) -> float:
        return backlog_ms + outside * self.ms_per_outside + uncached_tokens * self.ms_per_token


@dataclass(frozen=True, slots=True)
class Predicted:
    backend_id: str
    uncached_tokens: float
    backlog_tokens: float = 0.0
    outside: float = 0.0
    prompt_chars: int = 0
    model: str = ""  # whose tokenizer the prompt's characters per token teach


def _clip(v: float, bounds: tuple[float, float]) -> float:
    return min(max(v, bounds[0]), bounds[1])


class PrefillRates:
    def __init__(self, pending_capacity: int = 100_000) -> None:
        self._rates: dict[str, Rates] = {}
        self._pending: OrderedDict[str, Predicted] = OrderedDict()
        self._capacity = pending_capacity
        self._work: dict[str, tuple[float, float]] = {}  # backend -> (backlog tokens, as of)
        # model -> (characters, tokens) of its recent prompts; bounded by the fleet's models.
        self._sizes: dict[str, tuple[float, float]] = {}

    def chars_per_token(self, model: str) -> float:
        chars, tokens = self._sizes.get(model, (0.0, 0.0))
        return chars / tokens if tokens else CHARS_PER_TOKEN

    def rates(self, backend_id: str) -> Rates:
        return self._rates.get(backend_id, Rates())

    def backlog_tokens(self, backend_id: str, now: float) -> float:
        """Uncached prompt tokens Baton sent `backend_id` that are predicted still to be
        prefilled at `now` (control's clock, seconds)."""
        tokens, at = self._work.get(backend_id, (0.0, now))
        done = max(now - at, 0.0) * 1e3 / self.rates(backend_id).ms_per_token
        return max(tokens - done, 0.0)

    def backlog_ms(self, backend_id: str, now: float) -> float:
        return self.backlog_tokens(backend_id, now) * self.rates(backend_id).ms_per_token

    def predicted(self, request_id: str, prediction: Predicted, now: float) -> None:
        """A request routed at `now` with this prediction: its own prefill joins the backend's
        backlog, and the prediction waits for the outcome."""
        b = prediction.backend_id
        self._work[b] = (self.backlog_tokens(b, now) + prediction.uncached_tokens, now)
        self._pending[request_id] = prediction
        while len(self._pending) > self._capacity:
            self._pending.popitem(last=False)

    def observed(
        self, request_id: str, backend_id: str, ttft_ms: float, prompt_tokens: int = 0
    ) -> None:
        """The request's real TTFT. The error is split between the outside requests' term and
        the prefill rate (over the backlog's tokens and the prompt's own) in proportion to
        what each predicted; with no outside requests the rate takes it all. A request
        served elsewhere than predicted (a retry) teaches nothing."""
        p = self._pending.pop(request_id, None)
        if p is None or p.backend_id != backend_id or ttft_ms <= 0:
            return
        if p.prompt_chars and prompt_tokens >= MIN_TOKENS_TO_LEARN:
            chars, tokens = self._sizes.get(p.model, (0.0, 0.0))
            self._sizes[p.model] = (SIZE_MEMORY * chars + p.prompt_chars,
                                    SIZE_MEMORY * tokens + prompt_tokens)  # fmt: skip
        old = self.rates(backend_id)
        tokens = p.backlog_tokens + p.uncached_tokens  # prefilled before the first token
        learn_tokens = tokens >= MIN_TOKENS_TO_LEARN
        own_ms = old.ms_per_token * tokens
        outside_ms = old.ms_per_outside * p.outside
        error = ttft_ms - (own_ms + outside_ms)
        # The terms that learn, weighted by what each predicted (an outside rate learned down
        # to 0 keeps a small weight: it can come back).
        w_own = own_ms if learn_tokens else 0.0
        w_out = max(outside_ms, 1.0) if p.outside > 0 else 0.0
        if w_own + w_out <= 0:
            return
        share = w_out / (w_own + w_out)
        per_token, per_outside = old.ms_per_token, old.ms_per_outside
        if learn_tokens:
            per_token += ALPHA * error * (1 - share) / tokens
        if p.outside > 0:
            per_outside += ALPHA * error * share / p.outside
        self._rates[backend_id] = Rates(
            _clip(per_token, BOUNDS_PER_TOKEN), _clip(per_outside, BOUNDS_PER_OUTSIDE)
        )
