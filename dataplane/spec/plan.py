"""Router-level speculative decoding, the pure part: which requests may use it, how a round's
draft is judged against the target's scores, and the quality signals on the result.

A round: the draft proposes k tokens after the context; the target is asked for its own
greedy next token after context + draft[:i] for every i = 0..k, in k + 1 one-token
completions sent at once (the engine batches them into one step, and each reads the prefix
cache: a round costs in proportion to k, where one call scoring context + draft with
`prompt_logprobs` makes vLLM skip its prefix cache and prefill the whole context again,
0.06x the time per round at 8k tokens of context: bench/spec_verify.py). The accepted prefix
is the draft tokens the target would have chosen itself; then comes the target's own token
(where the draft was wrong, or the bonus after a fully accepted draft). For greedy decoding
the result is exactly the target's own output.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dataplane.request import ClientRequest, Endpoint, token_limit

# The APIs a speculative round speaks (dataplane/spec/rounds.py); others are served plainly.
SPEC_ENDPOINTS = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})
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
    if client.endpoint not in SPEC_ENDPOINTS or token_limit(body) is None:
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
    target: Sequence[tuple[int | None, str | None]],
    remaining: int,
) -> Judged:
    """`target[i]`: the target's own greedy next token after context + draft[:i] and the
    finish reason of that one-token completion ("stop": the sequence ends there, whether
    the engine returned the end token or not), for i = 0 .. len(draft)."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(target)} target answers for a draft of {len(draft)}")
    tokens: list[int] = []
    finish: str | None = None
    accepted = 0
    for i, (own, why) in enumerate(target):
        if why == "stop":
            finish = "stop"  # the target ends the sequence here
            break
        if own is None:
            raise ValueError(f"the target sent no token after {i} draft tokens")
        if i == len(draft) or own != draft[i]:
            tokens.append(own)  # its own token where the draft was wrong, or the bonus
            break
        tokens.append(own)
        accepted += 1
    if len(tokens) >= remaining:
        tokens = tokens[:remaining]
        finish = finish or "length"
    return Judged(accepted, tuple(tokens), finish)


def next_k(k: int, drafted: int, accepted: int, most: int) -> int:
    """How many tokens the next round drafts: two more after a proposal the target took whole,
    one fewer after one it cut (the "heuristic" schedule of transformers' assisted
    generation), within 1..most. A pair that agrees drafts long rounds, where a round's fixed
    cost (two calls) buys the most tokens; one that disagrees drafts short ones, and the
    target is not asked to verify tokens it will refuse."""
    if drafted > 0 and accepted >= drafted:
        return min(most, k + 2)
    return max(1, min(most, k - 1))


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
