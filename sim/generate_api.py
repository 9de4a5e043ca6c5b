"""vLLM 0.32's token-in/token-out endpoint, ``POST /inference/v1/generate``: the request
checked into a GenRequest, and the response shapes (pure).

The generation is /v1/completions' over a prompt of ids (no chat template, no parser).
Request (vLLM's GenerateRequest): ``token_ids`` (non-empty, in the vocabulary),
``sampling_params`` (vLLM SamplingParams fields; the defaults are SamplingParams', so
temperature 1.0, except max_tokens, which falls back to the server's default capped by the
room left, and an explicit one over that room is cut there as vLLM's scheduler cuts it),
``model``, ``output_mode`` ("tokens", the default, or "text"), ``stream``,
``stream_options``, ``return_token_ids``, ``request_id``.

Stream chunks (``data: {...}``, then ``data: [DONE]``), one per choice's chunk of tokens,
fields in vLLM's order (its pydantic models)::

    {"request_id", "usage": null | {5 fields}, ["prompt_token_ids": [...]],
     "output_mode", "choices": [{"index", "finish_reason", "stop_reason", "token_ids",
     "routed_experts": null, "sampling_mask": null, "weight_versions": null,
     ["text"], "logprobs"}]}

``prompt_token_ids`` only on the first chunk and only with return_token_ids; ``text``
in text mode; ``logprobs`` null unless sampling_params.logprobs (sim.logprobs: chat's
shape in text mode, integer ids and ranks in tokens mode); with include_usage a last
chunk with no choices and ``usage`` (its None fields left out). The non-streamed body
is every field of vLLM's GenerateResponse, nulls included.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sim.logprob_request import check_count
from sim.protocol import (
    GenRequest,
    Limits,
    SamplingParams,
    bad_request,
    check_model,
    optional_field,
)
from sim.tokenizer import Tokenizer

Mode = Literal["tokens", "text"]
_PENALTIES = (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    req: GenRequest
    mode: Mode
    request_id: str | None  # the body's (else the header's, else a fresh one)


def parse_generate(body: Mapping[str, Any], tok: Tokenizer, limits: Limits) -> GenerateSpec:
    check_model(body, limits)
    ids = _token_ids(body.get("token_ids"), tok)
    sp = body.get("sampling_params")
    if not isinstance(sp, Mapping):
        raise bad_request("sampling_params: Field required (an object)", "sampling_params")
    mode = body.get("output_mode", "tokens")
    if mode not in ("tokens", "text"):
        raise bad_request("output_mode: Input should be 'tokens' or 'text'", "output_mode")
    stream = optional_field(body, "stream", bool, False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise bad_request("'stream_options' must be an object", "stream_options")
    opts = opts or {}
    include_usage = optional_field(opts, "include_usage", bool, False)
    continuous = include_usage and optional_field(opts, "continuous_usage_stats", bool, False)
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request("'request_id' must be a string", "request_id")
    params, n, k, interval = _sampling(sp, len(ids), limits, tok)
    detokenize = optional_field(sp, "detokenize", bool, True)
    if mode == "text" and not detokenize:
        raise bad_request(
            "output_mode='text' requires sampling_params.detokenize to be true", "output_mode"
        )
    if params.stop and not detokenize:
        raise bad_request(
            "stop strings are only supported when detokenize is True. "
            "Set detokenize=True to use stop.", "stop",
        )  # fmt: skip
    prompt_k = _prompt_logprobs(sp, tok.vocab_size)
    req = GenRequest(
        kind="completion", prompt_ids=ids, params=params, n=n, stream=stream,
        include_usage=stream and include_usage, continuous_usage=stream and continuous,
        return_token_ids=optional_field(body, "return_token_ids", bool, False),
        stream_interval=max(interval, limits.stream_interval), logprobs=k,
        prompt_logprobs=None if stream else prompt_k,  # the stream schema has no field for them
    )  # fmt: skip
    return GenerateSpec(req, mode, request_id)


def _token_ids(ids: object, tok: Tokenizer) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise bad_request("token_ids: a non-empty list of integers is required", "token_ids")
    if min(ids) < 0:
        raise bad_request("token_ids must not contain negative values", "token_ids")
    if max(ids) >= tok.vocab_size:
        raise bad_request(f"Token id {max(ids)} is out of vocabulary", "token_ids")
    return ids


def _sampling(
    sp: Mapping[str, Any], prompt_len: int, limits: Limits, tok: Tokenizer
) -> tuple[SamplingParams, int, int | None, int]:
    """SamplingParams' checks (its messages); what the sim cannot do is refused, not ignored."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"The decoder prompt (length {prompt_len}) plus the number of requested output "
            f"tokens (at least 1) is longer than the maximum model length of "
            f"{limits.max_model_len}.", "token_ids",
        )  # fmt: skip
    temperature = optional_field(sp, "temperature", float, 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    greedy = temperature < 1e-5
    top_p = optional_field(sp, "top_p", float, 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = optional_field(sp, "top_k", int, 0)
    if top_k < -1:
        raise bad_request(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "top_k")
    min_p = optional_field(sp, "min_p", float, 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {min_p}.", "min_p")
    _refuse_unsupported(sp, greedy, min_p)
    max_tokens = optional_field(sp, "max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    max_tokens = min(limits.default_max_tokens if max_tokens is None else max_tokens, room)
    min_tokens = optional_field(sp, "min_tokens", int, 0)
    if not 0 <= min_tokens <= max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
            f"{min_tokens}.", "min_tokens",
        )  # fmt: skip
    n = optional_field(sp, "n", int, 1)
    if not 1 <= n <= 128:
        raise bad_request(f"n must be at least 1, got {n}.", "n")
    if greedy and n > 1:
        raise bad_request(f"n must be 1 when using greedy sampling, got {n}.", "n")
    seed = optional_field(sp, "seed", int, None)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0 if greedy else temperature,
        top_p=1.0 if greedy else top_p, top_k=0 if greedy else max(top_k, 0),
        seed=None if seed == -1 else seed, stop=_stops(sp.get("stop")),
        ignore_eos=optional_field(sp, "ignore_eos", bool, False), min_tokens=min_tokens,
        include_stop_str_in_output=optional_field(sp, "include_stop_str_in_output", bool, False),
        allowed_token_ids=_ids(sp, "allowed_token_ids", tok),
        stop_token_ids=tuple(dict.fromkeys(_ids(sp, "stop_token_ids", tok))),
        skip_special_tokens=optional_field(sp, "skip_special_tokens", bool, True),
    )  # fmt: skip
    k = sp.get("logprobs")
    if k is not None:
        if k is True:
            k = 1  # SamplingParams turns logprobs=True into 1
        if type(k) is not int or (k < 0 and k != -1):
            raise bad_request(f"logprobs must be non-negative or -1, got {k}.", "logprobs")
        k = check_count(k, tok.vocab_size)
    interval = optional_field(sp, "stream_interval", int, 1)
    if interval < 1:
        raise bad_request(f"stream_interval must be at least 1, got {interval}.", "stream_interval")
    return params, n, k, interval


def _refuse_unsupported(sp: Mapping[str, Any], greedy: bool, min_p: float) -> None:
    if min_p > 0 and not greedy:
        raise bad_request("min_p is not supported by the sim (its sampler has no min_p)", "min_p")
    for name, default in _PENALTIES:
        if optional_field(sp, name, float, default) != default:
            raise bad_request(f"{name} is not supported by the sim", name)


def _stops(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop: a string or a list of strings", "stop")
    if not all(stops):
        raise bad_request("stop cannot contain an empty string.", "stop")
    return tuple(stops)


def _ids(sp: Mapping[str, Any], name: str, tok: Tokenizer) -> tuple[int, ...]:
    raw = sp.get(name)
    if raw is None:
        return ()
    if not isinstance(raw, list) or not tok.valid_ids(raw):
        raise bad_request(f"{name} must be a list of token ids in [0, {tok.vocab_size})", name)
    return tuple(raw)


def _prompt_logprobs(sp: Mapping[str, Any], vocab_size: int) -> int | None:
    k = sp.get("prompt_logprobs")
    if k is None:
        return None
    if type(k) is not int or (k < 0 and k != -1):
        raise bad_request(f"prompt_logprobs must be non-negative or -1, got {k}.",
                          "prompt_logprobs")  # fmt: skip
    return check_count(k, vocab_size)


# -- responses ---------------------------------------------------------------------------
def usage_info(prompt: int, completion: int) -> dict[str, Any]:
    """vLLM's UsageInfo, every field (a streamed chunk's usage is not trimmed)."""
    return {
        "prompt_tokens": prompt, "total_tokens": prompt + completion,
        "completion_tokens": completion, "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }  # fmt: skip


def _choice(
    mode: Mode, index: int, text: str, ids: Sequence[int], finish: str | None,
    stop_reason: str | int | None, logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index, "finish_reason": finish, "stop_reason": stop_reason,
        "token_ids": list(ids), "routed_experts": None, "sampling_mask": None,
        "weight_versions": None,
    }  # fmt: skip
    if mode == "text":
        choice["text"] = text
    choice["logprobs"] = logprobs
    return choice


def stream_chunk(
    request_id: str, mode: Mode, index: int, text: str, ids: Sequence[int],
    finish: str | None, stop_reason: str | int | None, logprobs: dict[str, Any] | None,
    prompt_ids: Sequence[int] | None = None, usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {"request_id": request_id, "usage": usage}
    if prompt_ids is not None:
        chunk["prompt_token_ids"] = list(prompt_ids)
    chunk["output_mode"] = mode
    chunk["choices"] = [_choice(mode, index, text, ids, finish, stop_reason, logprobs)]
    return chunk


def usage_chunk(request_id: str, mode: Mode, prompt: int, completion: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
             "completion_tokens": completion}  # fmt: skip
    return {"request_id": request_id, "usage": usage, "output_mode": mode, "choices": []}


@dataclass(frozen=True, slots=True)
class Choice:
    text: str
    token_ids: Sequence[int]
    finish_reason: str
    stop_reason: str | int | None
    logprobs: dict[str, Any] | None


def full_response(
    request_id: str, mode: Mode, model: str, created: int, prompt_ids: Sequence[int],
    choices: Sequence[Choice], *, return_token_ids: bool,
    prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "request_id": request_id, "model": model, "created": created,
        "usage": usage_info(len(prompt_ids), completion),
        "prompt_logprobs": prompt_logprobs, "prompt_token_id_logprobs": None,
        "prompt_token_ids": list(prompt_ids) if return_token_ids else None,
        "mm_placeholders": None, "metrics": None, "kv_transfer_params": None,
        "ec_transfer_params": None, "output_mode": mode,
        "choices": [
            _choice(mode, i, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
            for i, c in enumerate(choices)
        ],
    }  # fmt: skip
