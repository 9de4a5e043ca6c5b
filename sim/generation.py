"""One generated sequence (one choice): decoding, EOS, length and stop strings (pure).

Text release follows vLLM's detokenizer: with stop strings, the last
``max(len(stop)) - 1`` characters are held back until they can no longer start
a stop string, and the output is cut before the stop string (which is not
included). Token ids are reported as generated, including the token that
completed a stop string and the EOS token, and count as completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from random import Random

from sim.model import ToyModel
from sim.protocol import SamplingParams
from sim.tokenizer import EOS


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    text: str  # text released to the client with this token (may be "")
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: str | None = None  # the stop string that ended it, if any


class Sequence:
    """Generates one choice token by token. Mutable, owned by one request."""

    __slots__ = (
        "_model", "_params", "_texts", "_prompt", "_h", "_last", "_rng", "_stops", "_hold",
        "_buf", "_sent", "token_ids", "finish_reason", "stop_reason",
    )

    def __init__(
        self,
        model: ToyModel,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        prompt_hash: int | None = None,
    ) -> None:
        self._model = model
        self._params = params
        self._texts = model.tokenizer.texts
        self._prompt = prompt_ids  # read only by degenerate (looping) models
        self._h = model.start(prompt_ids) if prompt_hash is None else prompt_hash
        self._last: int | None = prompt_ids[-1] if prompt_ids else None
        self._rng: Random | None = None
        if params.temperature > 0:
            # Seed + choice index, like vLLM's per-request generator; no seed = fresh entropy.
            self._rng = Random(params.seed + index) if params.seed is not None else Random()
        self._stops = params.stop
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._buf = ""
        self._sent = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output_text(self) -> str:
        """All text generated so far, as a non-streaming response reports it."""
        if self._stops:
            return self._buf  # already cut before the stop string
        return self._model.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _loop_token(self) -> int | None:
        """history[loop_index] of prompt + generated, without concatenating them."""
        n_prompt, out = len(self._prompt), self.token_ids
        i = self._model.loop_index(n_prompt + len(out))
        if i is None:
            return None
        return self._prompt[i] if i < n_prompt else out[i - n_prompt]

    def _next_id(self) -> int:
        p = self._params
        allow_eos = not p.ignore_eos and len(self.token_ids) >= p.min_tokens
        loop = self._loop_token() if self._model.loops else None
        if self._rng is None:
            return self._model.greedy(self._h, self._last, allow_eos=allow_eos, loop=loop)
        return self._model.sample(
            self._h, self._last, self._rng,
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, allow_eos=allow_eos,
            loop=loop,
        )

    def step(self) -> TokenEvent:
        if self.finish_reason is not None:
            raise RuntimeError("sequence already finished")
        tid = self._next_id()
        self.token_ids.append(tid)
        self._h = self._model.advance(self._h, tid)
        self._last = tid
        at_limit = len(self.token_ids) >= self._params.max_tokens
        if not self._stops:
            if tid == EOS:
                return self._end("", "stop")
            text = self._texts[tid]
            return self._end(text, "length") if at_limit else TokenEvent(tid, text, None)
        return self._step_with_stops(tid, at_limit)

    def run_to_end(self) -> None:
        """Generate until finished: the non-streaming fast path.

        Greedy without stop strings (the common router/benchmark case) runs in
        a local loop that produces exactly what repeated step() calls would.
        """
        if self._rng is not None or self._stops or self._params.min_tokens or self._model.loops:
            while self.finish_reason is None:
                self.step()
            return
        greedy, advance = self._model.greedy, self._model.advance
        allow_eos = not self._params.ignore_eos
        h, last, ids = self._h, self._last, self.token_ids
        reason = "length"
        while len(ids) < self._params.max_tokens:
            tid = greedy(h, last, allow_eos=allow_eos)
            ids.append(tid)
            h, last = advance(h, tid), tid
            if tid == EOS:
                reason = "stop"
                break
        self._h, self._last = h, last
        self.finish_reason = reason

    def _step_with_stops(self, tid: int, at_limit: bool) -> TokenEvent:
        if tid == EOS:
            return self._end(self._release(len(self._buf)), "stop")
        before = len(self._buf)
        self._buf += self._texts[tid]
        start = max(0, before - self._hold)
        cut, matched = -1, None
        # Like vLLM, stop strings are not checked before min_tokens outputs.
        stops = self._stops if len(self.token_ids) >= self._params.min_tokens else ()
        for s in stops:
            i = self._buf.find(s, start)
            if i >= 0 and (cut < 0 or i < cut):
                cut, matched = i, s
        if matched is not None:
            text = self._release(cut)
            self._buf = self._buf[:cut]
            return self._end(text, "stop", matched)
        if at_limit:
            return self._end(self._release(len(self._buf)), "length")
        return TokenEvent(tid, self._release(len(self._buf) - self._hold), None)

    def _release(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        text = self._buf[self._sent : upto]
        self._sent = upto
        return text

    def _end(self, text: str, reason: str, stop: str | None = None) -> TokenEvent:
        self.finish_reason = reason
        self.stop_reason = stop
        return TokenEvent(self.token_ids[-1], text, reason, stop)
