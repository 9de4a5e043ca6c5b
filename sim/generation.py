"""One generated sequence (one choice): decoding, EOS, length and stop strings (pure).

Text release follows vLLM 0.32's detokenizer (FastIncrementalDetokenizer over
tokenizers' DecodeStream), see ``Detokenizer``: special tokens show no text unless the
request's ``skip_special_tokens`` is off (vLLM's default is on; a tool parser's
adjust_request may turn it off, sim.adjust); text
comes out only once the bytes since the last release decode to text that does
not end in U+FFFD, and bytes never released by the end are dropped. On top of
that, with stop strings, the last ``max(len(stop)) - 1`` released characters
are held back until they can no longer start a stop string, and the output is
cut before the stop string (after it with include_stop_str_in_output, which
also turns the hold-back off). Token ids are reported as generated, including
the token that completed a stop string and the EOS token, and count as
completion tokens; the text of the token that ended the choice (EOS, a stop token id)
is left out unless include_stop_str_in_output. For ASCII output every token releases its
own text at once.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from random import Random

from sim.model import MAX_RANKED, ToyModel
from sim.protocol import SamplingParams
from sim.tokenizer import EOS, Tokenizer
from sim.tool_script import ToolCallPlan

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """What vLLM 0.32 releases as text, token by token (pure, one per sequence).

    ``pending`` holds the bytes of the tokens since the last release (special
    tokens add none, unless ``skip_special_tokens`` is off: then their text).
    After each token the pending bytes are decoded with replacement; text
    that is non-empty and does not end in U+FFFD is released
    and pending is emptied, anything else waits (a genuine U+FFFD at the end
    waits too, as in tokenizers' DecodeStream).

    The prompt quirk: vLLM primes the DecodeStream with the prompt ids. When
    the prompt's own text ends in U+FFFD (it stops inside a character, e.g. a
    resume prompt cut mid-character), the stream has no clean prefix yet, and
    its first release is the text of the whole prompt (specials stripped, or
    spelled with ``skip_special_tokens`` off) followed by the new text. That is
    the same rule with pending starting out as the prompt's bytes.
    """

    __slots__ = ("_visible", "_whole", "_pending", "primed")

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Seq[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._visible, self._whole = tokenizer.shown(skip_special_tokens)
        self._pending = bytearray()
        # True when the prompt ends mid-character (its text comes out first).
        self.primed = starts_primed(tokenizer, prompt_ids, skip_special_tokens)
        if self.primed:
            self._pending += tokenizer.visible_bytes(
                prompt_ids, skip_special_tokens=skip_special_tokens
            )

    def step(self, token_id: int) -> str:
        """The text released by this token ("" when none)."""
        pending = self._pending
        if not pending:
            text = self._whole[token_id]
            if text is not None:  # whole characters on its own (or a special: "")
                return text
        pending += self._visible[token_id]
        text = pending.decode("utf-8", errors="replace")
        if text and not text.endswith(_REPLACEMENT):
            pending.clear()
            return text
        return ""


def starts_primed(
    tokenizer: Tokenizer, prompt_ids: Seq[int], skip_special_tokens: bool = True
) -> bool:
    """Whether a stream after this prompt releases the prompt's text first (Detokenizer)."""
    return bool(prompt_ids) and tokenizer.ends_mid_character(
        prompt_ids, skip_special_tokens=skip_special_tokens
    )


def released_text(
    tokenizer: Tokenizer, prompt_ids: Seq[int], ids: Seq[int], *,
    primed: bool | None = None, skip_special_tokens: bool = True,
) -> str:
    """All text a stream over ``ids`` releases (what a non-streaming response holds).

    ``primed``: Detokenizer(tokenizer, prompt_ids, ...).primed, when already known.
    """
    skip = skip_special_tokens
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    if primed is None:
        primed = starts_primed(tokenizer, prompt_ids, skip)
    if not primed and not text.endswith(_REPLACEMENT):
        return text  # every byte was released: the releases add up to the plain decode
    detok = Detokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    return "".join(detok.step(t) for t in ids)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    text: str  # text released to the client with this token (may be "")
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: str | int | None = None  # the stop string (or stop token id) that ended it


class Sequence:
    """Generates one choice token by token. Mutable, owned by one request."""

    __slots__ = (
        "_model", "_params", "_detok", "_prompt", "_h", "_last", "_rng", "_stops", "_hold",
        "_back", "_buf", "_sent", "_tool", "token_ids", "finish_reason", "stop_reason",
        "forced",
    )

    def __init__(
        self,
        model: ToyModel,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        prompt_hash: int | None = None,
        tool: ToolCallPlan | None = None,
    ) -> None:
        self._model = model
        self._tool = tool  # tool-call mode: the call this choice makes (sim.tools)
        self._params = params
        self._detok = Detokenizer(
            model.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens
        )
        self._prompt = prompt_ids  # read by degenerate (looping) models and output_text
        self._h = model.start(prompt_ids) if prompt_hash is None else prompt_hash
        self._last: int | None = prompt_ids[-1] if prompt_ids else None
        self._rng: Random | None = None
        if params.temperature > 0:
            # Seed + choice index, like vLLM's per-request generator; no seed = fresh entropy.
            self._rng = Random(params.seed + index) if params.seed is not None else Random()
        self._stops = params.stop
        # A stop string may start this many characters before the new text.
        self._back = max((len(s) for s in params.stop), default=1) - 1
        self._hold = 0 if params.include_stop_str_in_output else self._back
        self._buf = ""
        self._sent = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.forced = False  # the last token was the tool-call script's, not the model's pick

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output_text(self) -> str:
        """All text generated so far, as a non-streaming response reports it."""
        if self._stops:
            return self._buf  # already cut at the stop string
        ids, p = self.token_ids, self._params
        ended_by_token = isinstance(self.stop_reason, int) or (
            self.finish_reason == "stop" and ids[-1:] == [EOS]
        )
        if ended_by_token and not p.include_stop_str_in_output:
            ids = ids[:-1]  # EOS or a stop token id: vLLM's detokenizer leaves its text out
        return released_text(self._model.tokenizer, self._prompt, ids, primed=self._detok.primed,
                             skip_special_tokens=p.skip_special_tokens)  # fmt: skip

    def _loop_token(self) -> int | None:
        """history[loop_index] of prompt + generated, without concatenating them."""
        n_prompt, out = len(self._prompt), self.token_ids
        i = self._model.loop_index(n_prompt + len(out))
        if i is None:
            return None
        return self._prompt[i] if i < n_prompt else out[i - n_prompt]

    def ranking(self) -> tuple[int, ...]:
        """The model's ranking at the next position, best first (MAX_RANKED ids): what vLLM's
        raw logprobs see, before the min_tokens / ignore_eos / allowed_token_ids masks.
        Call before step(); sim.logprobs puts a tool-call script's token first (``forced``)."""
        loop = self._loop_token() if self._model.loops else None
        return self._model.candidates(self._h, self._last, MAX_RANKED, loop=loop).ids

    def _next_id(self) -> int:
        p = self._params
        self.forced = False
        if p.allowed_token_ids:
            return self._allowed_id(p.allowed_token_ids)
        allow_eos = not p.ignore_eos and len(self.token_ids) >= p.min_tokens
        if self._tool is not None:
            forced = self._tool.next(self._h, allow_eos=allow_eos)
            if forced is not None:
                self.forced = True
                return forced
        loop = self._loop_token() if self._model.loops else None
        if self._rng is None:
            return self._model.greedy(self._h, self._last, allow_eos=allow_eos, loop=loop)
        return self._model.sample(
            self._h, self._last, self._rng,
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, allow_eos=allow_eos,
            loop=loop,
        )

    def _allowed_id(self, allowed: Seq[int]) -> int:
        """vLLM's allowed_token_ids masks every other logit: the toy model's best-ranked
        allowed candidate, else the lowest allowed id (the toy model ranks only a few)."""
        ranked = self._model.candidates(self._h, self._last, 8, allow_eos=EOS in allowed).ids
        return next((t for t in ranked if t in allowed), min(allowed))

    def step(self) -> TokenEvent:
        if self.finish_reason is not None:
            raise RuntimeError("sequence already finished")
        tid = self._next_id()
        self.token_ids.append(tid)
        self._h = self._model.advance(self._h, tid)
        self._last = tid
        at_limit = len(self.token_ids) >= self._params.max_tokens
        if tid != EOS and tid in self._params.stop_token_ids:
            return self._stop_token(tid)
        if not self._stops:
            if tid == EOS:
                return self._end(self._eos_text(), "stop")
            text = self._detok.step(tid)
            return self._end(text, "length") if at_limit else TokenEvent(tid, text, None)
        return self._step_with_stops(tid, at_limit)

    def run_to_end(self) -> None:
        """Generate until finished: the non-streaming fast path.

        Greedy without stop strings (the common router/benchmark case) runs in
        a local loop that produces exactly what repeated step() calls would.
        """
        if (
            self._rng is not None or self._stops or self._params.min_tokens or self._model.loops
            or self._tool is not None or self._params.allowed_token_ids
            or self._params.stop_token_ids
        ):
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
            self._buf += self._eos_text()
            return self._end(self._release(len(self._buf)), "stop")
        before = len(self._buf)
        new = self._detok.step(tid)
        self._buf += new
        start = max(0, before - self._back)
        cut, matched = -1, None
        # Like vLLM, stop strings are not checked before min_tokens outputs, nor
        # when no text was released (the output did not grow).
        stops = self._stops if new and len(self.token_ids) >= self._params.min_tokens else ()
        for s in stops:
            i = self._buf.find(s, start)
            if i >= 0 and (cut < 0 or i < cut):
                cut, matched = i, s
        if matched is not None:
            if self._params.include_stop_str_in_output:
                cut += len(matched)
            text = self._release(cut)
            self._buf = self._buf[:cut]
            return self._end(text, "stop", matched)
        if at_limit:
            return self._end(self._release(len(self._buf)), "length")
        return TokenEvent(tid, self._release(len(self._buf) - self._hold), None)

    def _stop_token(self, tid: int) -> TokenEvent:
        """vLLM checks stop token ids right after EOS (before the length cap and min_tokens),
        and leaves the token out of the text unless include_stop_str_in_output."""
        new = self._detok.step(tid) if self._params.include_stop_str_in_output else ""
        if not self._stops:
            return self._end(new, "stop", tid)
        self._buf += new
        return self._end(self._release(len(self._buf)), "stop", tid)

    def _eos_text(self) -> str:
        """vLLM does not detokenize the EOS token unless include_stop_str_in_output (then
        its text shows where special tokens are not skipped)."""
        return self._detok.step(EOS) if self._params.include_stop_str_in_output else ""

    def _release(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        text = self._buf[self._sent : upto]
        self._sent = upto
        return text

    def _end(self, text: str, reason: str, stop: str | int | None = None) -> TokenEvent:
        self.finish_reason = reason
        self.stop_reason = stop
        return TokenEvent(self.token_ids[-1], text, reason, stop)
