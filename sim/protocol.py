"""Request bodies -> validated domain values (pure). Mirrors vLLM's field rules.

Unknown fields are accepted and ignored, as vLLM does. Errors raise ApiError,
which the server renders as ``{"error": {"message","type","param","code"}}``.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from sim.chat_template import TemplateError, parse_messages, render
from sim.model import MAX_RANKED
from sim.tokenizer import BOS, Tokenizer
from sim.tools import ToolSpec

MAX_PROMPT_LOGPROBS = MAX_RANKED  # the model ranks this many candidates per position


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-server facts a request is validated against."""

    model: str
    max_model_len: int
    default_max_tokens: int
    default_temperature: float
    # The rest of the server's generation config (vLLM --generation-config):
    # applied when a request leaves the field out; an explicit value wins.
    default_top_p: float = 1.0
    default_top_k: int = 0  # 0 = off (-1, vLLM's spelling, is normalised to 0)
    default_seed: int | None = None
    stream_interval: int = 1  # vLLM --stream-interval: tokens batched per streamed chunk


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop strings are suppressed before this many outputs
    include_stop_str_in_output: bool = False
    # vLLM's allowed_token_ids: every other token (EOS included) is masked out.
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's stop_token_ids: such a token ends the choice (stop_reason = its id); its text is
    # left out unless include_stop_str_in_output. (/inference/v1/generate only, for now.)
    stop_token_ids: tuple[int, ...] = ()
    # Special tokens show no text (vLLM's default); a chat request's tool parser may turn
    # it off (sim.adjust), as may the request itself.
    skip_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class GenRequest:
    kind: Literal["chat", "completion"]
    prompt_ids: list[int]  # never mutated; a list to avoid copying long prompts
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    # stream_options.continuous_usage_stats (with include_usage): usage on every chunk
    continuous_usage: bool = False
    return_token_ids: bool = False
    role: str = "assistant"  # chat only: role of the streamed message
    prompt_logprobs: int | None = None  # completions only: top-k to score at each prompt position
    include_reasoning: bool = True  # chat with a reasoning parser: send the reasoning part
    # Tokens per streamed chunk (vLLM's stream_interval, raised to the server's): the first
    # and the last chunk go at once, the rest every this many tokens.
    stream_interval: int = 1
    # Chat in tool-call mode offering tools with tool_choice auto: the tools the
    # template rendered, and the tool parser runs (sim.tools). None = neither.
    tool: ToolSpec | None = None
    # Refused by the engine's input processor (a 400 that vLLM reports only once the
    # generation starts: in-band on a stream), e.g. a thinking budget with no reasoning.
    rejected: str | None = None
    # Sampled-token logprobs: how many top candidates each position reports (chat's
    # top_logprobs with logprobs true, completions' logprobs; sim.logprobs). None = off.
    logprobs: int | None = None
    # Chat: tool_choice is "none" as vLLM resolves it (absent: "auto" with tools, else
    # "none"); then no tool parser's adjust_request runs for it (sim.adjust).
    tool_choice_none: bool = True


def check_model(body: Mapping[str, Any], limits: Limits) -> None:
    model = body.get("model")
    if model is None:
        return  # vLLM falls back to the served model
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model != limits.model:
        raise ApiError(
            404, f"The model `{model}` does not exist. Valid aliases: {limits.model}.",
            "NotFoundError", "model",
        )  # fmt: skip


def parse_chat(body: Mapping[str, Any], tok: Tokenizer, limits: Limits) -> GenRequest:
    check_model(body, limits)
    if body.get("prompt_logprobs") is not None:
        # Scoring is a completions feature here; refusing beats silently ignoring it.
        raise bad_request(
            "'prompt_logprobs' is only supported on /v1/completions", "prompt_logprobs"
        )
    # Tool-call mode: tools offered with tool_choice auto are rendered into the prompt
    # (the model reads them there: sim.tool_prompt); otherwise tools are ignored.
    tool = parse_tools(body) if tok.tool_call_start is not None else None
    try:
        messages = parse_messages(body.get("messages"))
        add_gen = optional_field(body, "add_generation_prompt", bool, True)
        cont = optional_field(body, "continue_final_message", bool, False)
        text = render(
            messages, add_generation_prompt=add_gen, continue_final_message=cont,
            open_think=tok.think_start is not None,
            tools=tool.tools if tool else None, parallel_tool_calls=tool.parallel if tool else True,
        )
    except TemplateError as e:
        raise bad_request(str(e), "messages") from None
    prompt_ids = tok.encode(text)
    max_tokens = optional_field(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = optional_field(body, "max_tokens", int, None)
    role = "assistant" if add_gen else messages[-1].role
    req = build_gen_request(body, "chat", prompt_ids, max_tokens, limits, role=role)
    _check_allowed(req, tok)
    include_reasoning = optional_field(body, "include_reasoning", bool, True)
    if not include_reasoning:
        req = replace(req, include_reasoning=False)
    if tool is not None:
        req = replace(req, tool=tool)
    if tool_choice(body) != "none":
        req = replace(req, tool_choice_none=False)
    budget = body.get("thinking_token_budget")
    if budget is not None:
        if type(budget) is not int or budget < -1:
            raise bad_request(
                "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
                "thinking_token_budget",
            )
        if budget != -1 and tok.think_start is None:  # vLLM's input processor
            req = replace(req, rejected=NO_REASONING_CONFIG)
    return req


# Accepted (and not enforced: the toy's think blocks end on their own) with --reasoning.
NO_REASONING_CONFIG = (
    "thinking_token_budget is set but reasoning_config is not configured. Please set "
    "--reasoning-parser and/or --reasoning-config to use thinking_token_budget."
)


def parse_tools(body: Mapping[str, Any]) -> ToolSpec | None:
    """``tools`` and ``tool_choice`` as vLLM checks them; the call to make, if any (sim.tools)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list of function tools", "tools")
        if not tools:
            raise bad_request(  # vLLM's wording
                "`tools` must not be an empty array. Either provide at least one tool or "
                "omit the field entirely.", "tools",
            )  # fmt: skip
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if (
                not isinstance(fn, Mapping)
                or tool.get("type", "function") != "function"
                or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("parameters"), Mapping | None)
            ):
                raise bad_request(
                    f"tools[{i}] must be {{'type': 'function', 'function': {{'name': a string, "
                    "'parameters': an object}}}}", "tools",
                )  # fmt: skip
    choice = tool_choice(body)
    if choice == "none" or (choice is None and not tools):
        return None
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "required" or isinstance(choice, Mapping):
        raise bad_request(
            "tool_choice 'required' and a named tool_choice are not supported by the sim "
            "(vLLM serves them with guided decoding)", "tool_choice",
        )  # fmt: skip
    if choice not in ("auto", None):
        raise bad_request(  # vLLM's wording
            f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", "
            "\"auto\" or \"required\" are supported.", "tool_choice",
        )  # fmt: skip
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return ToolSpec(tuple(tools), parallel is not False)


def tool_choice(body: Mapping[str, Any]) -> Any:
    """vLLM: with tools and no tool_choice, "auto"; an explicit null behaves as "auto" too."""
    if "tool_choice" in body:
        return body["tool_choice"]
    return "auto" if body.get("tools") else "none"


def parse_completion(body: Mapping[str, Any], tok: Tokenizer, limits: Limits) -> GenRequest:
    check_model(body, limits)
    add_special = optional_field(body, "add_special_tokens", bool, True)
    prompt_ids = prompt_to_ids(body.get("prompt"), tok, add_special)
    max_tokens = optional_field(body, "max_tokens", int, None)
    req = build_gen_request(body, "completion", prompt_ids, max_tokens, limits)
    _check_allowed(req, tok)
    k = optional_field(body, "prompt_logprobs", int, None)
    if k is None:
        return req
    if not 0 <= k <= MAX_PROMPT_LOGPROBS:
        # vLLM's max_logprobs bound (20 by default) also caps prompt_logprobs.
        raise bad_request(
            f"'prompt_logprobs' must be between 0 and {MAX_PROMPT_LOGPROBS}, got {k}",
            "prompt_logprobs",
        )
    if req.stream:
        raise bad_request(
            "'prompt_logprobs' is not supported with stream=true", "prompt_logprobs"
        )
    return replace(req, prompt_logprobs=k)


def prompt_to_ids(prompt: object, tok: Tokenizer, add_special_tokens: bool) -> list[int]:
    """A string, a list of ids, or a one-element list of either (a batch of one)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tok.encode(prompt)
        return [BOS, *ids] if add_special_tokens else ids
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        if not tok.valid_ids(prompt):
            raise bad_request(
                f"'prompt' token ids must be integers in [0, {tok.vocab_size})", "prompt"
            )
        return prompt
    raise bad_request(
        "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
    )


def build_gen_request(
    body: Mapping[str, Any],
    kind: Literal["chat", "completion"],
    prompt_ids: list[int],
    max_tokens: int | None,
    limits: Limits,
    role: str = "assistant",
) -> GenRequest:
    """The fields chat, completions and Responses requests share, checked against `limits`:
    sampling, n, streaming, and the GenRequest they make with the prompt already parsed."""
    stream = optional_field(body, "stream", bool, False)
    stream_options = body.get("stream_options")
    include_usage = continuous = False
    if stream_options is not None:
        if not isinstance(stream_options, Mapping):
            raise bad_request("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad_request("Stream options can only be defined when stream=True.")
        include_usage = optional_field(stream_options, "include_usage", bool, False)
        continuous = optional_field(stream_options, "continuous_usage_stats", bool, False)
        # vLLM's should_include_usage: continuous stats only count with include_usage.
        continuous = continuous and include_usage
    n = optional_field(body, "n", int, 1)
    if not 1 <= n <= 128:
        raise bad_request("'n' must be between 1 and 128", "n")
    params = SamplingParams(
        max_tokens=_max_tokens(max_tokens, len(prompt_ids), limits),
        temperature=optional_field(body, "temperature", float, limits.default_temperature),
        top_p=optional_field(body, "top_p", float, limits.default_top_p),
        top_k=optional_field(body, "top_k", int, limits.default_top_k),
        seed=optional_field(body, "seed", int, limits.default_seed),
        stop=_stops(body.get("stop")),
        ignore_eos=optional_field(body, "ignore_eos", bool, False),
        min_tokens=optional_field(body, "min_tokens", int, 0),
        include_stop_str_in_output=optional_field(body, "include_stop_str_in_output", bool, False),
        allowed_token_ids=_allowed(body.get("allowed_token_ids")),
        skip_special_tokens=optional_field(body, "skip_special_tokens", bool, True),
    )
    if params.temperature < 0:
        raise bad_request("'temperature' must be >= 0", "temperature")
    if not 0 < params.top_p <= 1:
        raise bad_request("'top_p' must be in (0, 1]", "top_p")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise bad_request("'min_tokens' must be between 0 and max_tokens", "min_tokens")
    if params.top_k < -1:
        raise bad_request("'top_k' must be -1 (disable) or at least 1", "top_k")
    interval = optional_field(body, "stream_interval", int, None)
    if interval is not None and interval < 1:
        raise bad_request("'stream_interval' must be at least 1", "stream_interval")
    return GenRequest(
        kind=kind,
        prompt_ids=prompt_ids,
        params=params,
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=optional_field(body, "return_token_ids", bool, False),
        role=role,
        stream_interval=max(interval or 1, limits.stream_interval),
    )


def _allowed(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise bad_request(
            "'allowed_token_ids' must be a non-empty list of token ids", "allowed_token_ids"
        )
    return tuple(value)


def _check_allowed(req: GenRequest, tok: Tokenizer) -> None:
    if not tok.valid_ids(req.params.allowed_token_ids):
        raise bad_request("allowed_token_ids contains out-of-vocab token id", "allowed_token_ids")


def _max_tokens(requested: int | None, prompt_len: int, limits: Limits) -> int:
    room = limits.max_model_len - prompt_len
    if requested is None:
        if room < 1:
            raise bad_request(_too_long(limits, prompt_len, 1))
        return min(limits.default_max_tokens, room)
    if requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}.", "max_tokens")
    if requested > room:
        raise bad_request(_too_long(limits, prompt_len, requested))
    return requested


def _too_long(limits: Limits, prompt_len: int, max_tokens: int) -> str:
    # vLLM's wording, so clients that pattern-match it keep working.
    return (
        f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
        f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
        f"{max_tokens} in the completion). Please reduce the length of the messages or completion."
    )


def _stops(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(s for s in raw if s)
    raise bad_request("'stop' must be a string or a list of strings", "stop")


def optional_field(body: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    """Optional typed field; null means default. Rejects bools posing as numbers."""
    value = body.get(key)
    if value is None:
        return default
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool):
        raise bad_request(f"'{key}' must be an integer", key)
    if not isinstance(value, kind):
        raise bad_request(f"'{key}' must be of type {kind.__name__}", key)
    return value
