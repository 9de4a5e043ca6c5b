"""Resuming a stream that asked for logprobs (pure): on vLLM's token-in/token-out endpoint,
`POST /inference/v1/generate` (vLLM 0.32, served with `--enable-scale-out`).

/v1/completions, the token path's usual endpoint, cannot carry them faithfully: its
`top_logprobs` is a map keyed by decoded token, so two candidates that decode alike (the byte
tokens of a split character) collapse into one. The generate endpoint takes the same prompt
of ids and, with `output_mode: "text"`, gives each token's logprobs in chat's own shape
(token, logprob, bytes, top_logprobs), which Baton passes to a chat client as they are and
turns into completions' shape for a completions client.

vLLM corrects a decoded token that ends inside a character with the few tokens the request
generated before it (never its prompt), so a resume starts at least CONTEXT tokens early and
checks them by id (the seam overlap): the tokens the client lacks then decode with the same
context as in an uninterrupted stream."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from baton.model import SeamMode
from dataplane.request import ClientRequest, Endpoint

PATH = "/inference/v1/generate"
CONTEXT = 4  # vLLM's max_context in _correct_decoded_token
# Client fields that are vLLM SamplingParams fields (the generate request's sampling_params).
SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "bad_words", "allowed_token_ids", "logit_bias",
    "stream_interval",
)  # fmt: skip


def logprobs_wanted(client: ClientRequest) -> int | None:
    """How many top candidates the client's stream carries per token (chat's top_logprobs,
    completions' logprobs); None when it asked for no logprobs."""
    body = client.body
    if client.endpoint is Endpoint.CHAT:
        if not body.get("logprobs"):
            return None
        k = body.get("top_logprobs")
        return int(k) if isinstance(k, int) and k > 0 else 0
    k = body.get("logprobs")
    return int(k) if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else None


def opens_exact(mode: SeamMode, client: ClientRequest) -> bool:
    """Whether a first resume starts from the exact prefix (parallel seam mode) rather than
    with an overlap checked inline. A logprobs stream always has its overlap: it is the
    context vLLM decodes the next tokens' candidates with (CONTEXT)."""
    return mode is SeamMode.PARALLEL and logprobs_wanted(client) is None


def refusal(client: ClientRequest) -> str | None:
    """Why a logprobs stream cannot be resumed faithfully at all (None: it can)."""
    if client.endpoint is Endpoint.COMPLETIONS and not client.greedy:
        # Completions shows k+1 candidates, chat's shape k: with a sampled token outside the
        # top k, the (k+1)-th is not in what the generate endpoint gives for k.
        return "logprobs of a sampled (not greedy) completions stream cannot be resumed"
    return None


def body(
    client: ClientRequest, token_ids: Sequence[int], k: int, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """The generate request that continues the generation after `token_ids` (the prompt's
    and the kept generated ids), `extra` the resume's own sampling fields (max_tokens...)."""
    sampling: dict[str, Any] = {name: client.body[name] for name in SAMPLING
                                if name in client.body}  # fmt: skip
    sampling.update(extra)
    sampling["logprobs"] = k
    out: dict[str, Any] = {
        "model": client.model,
        "token_ids": token_ids,
        "sampling_params": sampling,
        "output_mode": "text",
        "stream": True,
    }
    if "priority" in client.body:
        out["priority"] = client.body["priority"]
    return out
