"""The logprob fields of chat and completions requests, checked as vLLM 0.32 checks them
(pure): chat's ``logprobs`` / ``top_logprobs`` and completions' ``logprobs``, into
GenRequest.logprobs (the top candidates each position reports; sim.logprobs)."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sim.model import MAX_RANKED
from sim.protocol import GenRequest, Limits, bad_request, parse_chat, parse_completion
from sim.tokenizer import Tokenizer

MAX_LOGPROBS = MAX_RANKED  # vLLM's --max-logprobs default (20); the toy ranks that many


def parse_chat_with_logprobs(body: Mapping[str, Any], tok: Tokenizer, limits: Limits) -> GenRequest:
    req = parse_chat(body, tok, limits)
    k = chat_logprobs(body, tok.vocab_size)
    return req if k is None else replace(req, logprobs=k)


def parse_completion_with_logprobs(
    body: Mapping[str, Any], tok: Tokenizer, limits: Limits
) -> GenRequest:
    req = parse_completion(body, tok, limits)
    k = completion_logprobs(body, tok.vocab_size)
    return req if k is None else replace(req, logprobs=k)


def chat_logprobs(body: Mapping[str, Any], vocab_size: int) -> int | None:
    """``logprobs: true`` asks for them; ``top_logprobs`` (default 0) says how many
    candidates (vLLM: it needs logprobs true; -1 means the whole vocabulary)."""
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int | float)):
        raise bad_request("`top_logprobs` must be an integer.", "top_logprobs")
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad_request("'logprobs' must be of type bool", "logprobs")
    if top is not None:
        if top < 0 and top != -1:
            raise bad_request("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if (top == -1 or top > 0) and not on:
            raise bad_request(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
    if not on:
        return None
    return check_count(int(top or 0), vocab_size)


def completion_logprobs(body: Mapping[str, Any], vocab_size: int) -> int | None:
    k = body.get("logprobs")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int | float):
        raise bad_request("`logprobs` must be an integer.", "logprobs")
    if k < 0 and k != -1:
        raise bad_request("`logprobs` must be a positive value or -1.", "logprobs")
    return check_count(int(k), vocab_size)


def check_count(k: int, vocab_size: int) -> int:
    """vLLM's engine-side bound: -1 is the whole vocabulary, over --max-logprobs is a 400."""
    n = vocab_size if k == -1 else k
    if n > MAX_LOGPROBS:
        raise bad_request(
            f"Requested sample logprobs of {n}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}", "logprobs",
        )  # fmt: skip
    return n
