"""Router-level speculative decoding, the pure part: which requests may use it, how a round's
draft is judged against the target's scores, and the quality signals on the result.

A round: the draft proposes k tokens after the context; the target scores context + draft in
one call (`prompt_logprobs`, greedy rank per position) and generates one token after it. The
accepted prefix is the draft tokens the target ranks first; then comes the target's own token
(its argmax where the draft was rejected, or the generated bonus token when all were
accepted). For greedy decoding the result is exactly the target's own output.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dataplane.validate import ClientRequest, token_limit

# Anything that changes the target's distribution or output shape beyond greedy text.
_INELIGIBLE = (
    "n", "logprobs", "top_logprobs", "tools", "functions", "tool_choice", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "stop",
    "stop_token_ids", "min_tokens", "ignore_eos", "best_of", "echo", "suffix",
    "prompt_logprobs",
)  # fmt: skip


def spec_eligible(client: ClientRequest) -> bool:
    """One plain choice with an explicit length cap: the shim must know where to stop without
    the engine's defaults, and nothing but greedy argmax may decide the tokens. (Whether the
    decoding is greedy is control's call when temperature is left to the backend's default.)"""
    body = client.body
    if token_limit(body) is None:
        return False
    for key in _INELIGIBLE:
        v = body.get(key)
        if v is None or (key == "n" and v == 1) or (key in ("logprobs", "echo") and v is False):
            continue
        return False
    return "temperature" not in body or client.greedy


def sets_temperature(client: ClientRequest) -> bool:
    return client.body.get("temperature") is not None


@dataclass(frozen=True, slots=True)
class Judged:
    accepted: int  # draft tokens the target ranked first
    emitted: tuple[int, ...]  # accepted draft tokens, then the target's own token
    finished: str | None = None  # "stop" (end of sequence) | "length" | None


def judge(
    draft: Sequence[int],
    prompt_logprobs: Sequence[Mapping[str, Any] | None],
    bonus: Sequence[int],
    bonus_finish: str | None,
    remaining: int,
    eos: int | None,
) -> Judged:
    """`prompt_logprobs` covers context + draft (one entry per token; the draft's are the last
    len(draft)); `bonus` is what the target generated after the whole draft."""
    entries = prompt_logprobs[len(prompt_logprobs) - len(draft) :] if draft else []
    accepted = 0
    own: int | None = None
    for token, entry in zip(draft, entries, strict=True):
        top = _argmax(entry)
        if top is None:
            raise ValueError("prompt_logprobs entry without a rank-1 token")
        if top != token:
            own = top
            break
        accepted += 1
    tokens = list(draft[:accepted])
    finish: str | None = None
    if eos is not None and eos in tokens:  # the draft ended the sequence and it was accepted
        tokens = tokens[: tokens.index(eos)]
        finish = "stop"
    elif own is not None:
        if own == eos:
            finish = "stop"
        else:
            tokens.append(own)
    elif bonus:
        if bonus[0] == eos:
            finish = "stop"
        else:
            tokens.append(bonus[0])
            if bonus_finish == "stop":
                finish = "stop"
    elif bonus_finish == "stop":
        finish = "stop"  # the engine ended on EOS and did not return it
    if len(tokens) >= remaining:
        tokens = tokens[:remaining]
        finish = finish or "length"
    return Judged(accepted, tuple(tokens), finish)


def _argmax(entry: Mapping[str, Any] | None) -> int | None:
    if not entry:
        return None
    for token_id, info in entry.items():
        if isinstance(info, Mapping) and info.get("rank") == 1:
            return int(token_id)
    return None


def repeated_ngram(ids: Sequence[int], *, window: int = 64, max_period: int = 16,
                   min_repeats: int = 4) -> bool:  # fmt: skip
    """The tail of the output is one short n-gram over and over (a degenerate loop)."""
    tail = ids[-window:]
    for period in range(1, max_period + 1):
        span = period * min_repeats
        if len(tail) < span:
            break
        end = tail[-span:]
        if all(end[i] == end[i - period] for i in range(period, span)):
            return True
    return False
