"""The Responses API (``/v1/responses``) as vLLM 0.32 serves it: request parsing (pure).

What a request becomes (vLLM's ``construct_input_messages``, responses/utils.py):
``instructions`` as a system message first, then the stored conversation of
``previous_response_id`` (its messages minus system ones, then its output text as
an assistant message), then ``input`` (a string is one user message; a list holds
message items). The messages go through the chat template exactly as a chat
request's would, so the same messages generate the same tokens on both endpoints
(greedy). A last assistant message whose ``status`` is "in_progress" or
"incomplete" is continued (continue_final_message), as in vLLM.

Sampling follows ``ResponsesRequest.to_sampling_params``: ``max_output_tokens``
is clamped to the room left in the context (no error), and the server's defaults
fill the fields a request leaves out. The shapes sent back are in
sim.responses_events.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.chat_template import Message, TemplateError, render
from sim.protocol import (
    ApiError,
    GenRequest,
    Limits,
    SamplingParams,
    bad_request,
    build_gen_request,
    optional_field,
)
from sim.tokenizer import Tokenizer

_ROLES = ("user", "assistant", "system", "developer", "tool")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields echoed into the response object as the request gave them (vLLM's from_request).
_ECHO_DEFAULTS: dict[str, Any] = {
    "instructions": None, "metadata": None, "max_tool_calls": None, "prompt": None,
    "reasoning": None, "service_tier": "auto", "text": None, "truncation": "disabled",
    "user": None,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    gen: GenRequest  # the generation, kind "chat"
    messages: tuple[Message, ...]  # what was rendered (kept with a stored response)
    prompt_text: str  # the rendered template (input_messages with enable_response_messages)
    response_id: str
    store: bool = True
    previous_response_id: str | None = None
    enable_response_messages: bool = False
    echo: dict[str, Any] = field(default_factory=dict)  # fields the response object repeats


def history(messages: Sequence[Message], output: Sequence[Mapping[str, Any]]) -> list[Message]:
    """What a follow-up inherits from a stored response: its messages without system
    ones (instructions do not carry over), then each output text as an assistant turn."""
    out = [m for m in messages if m.role != "system"]
    for item in output:
        if item.get("type") == "message":
            out.extend(Message("assistant", part["text"]) for part in item.get("content", ()))
    return out


def parse_responses(
    body: Mapping[str, Any],
    tok: Tokenizer,
    limits: Limits,
    *,
    response_id: str,
    earlier: Sequence[Message] = (),
) -> ResponsesRequest:
    """A /v1/responses body (and the earlier turn's messages) -> what to generate."""
    if body.get("background"):
        raise bad_request("background mode is not supported by the sim", "background")
    if body.get("prompt") is not None:
        raise bad_request("prompt template is not supported", "prompt")  # vLLM's wording
    instructions = optional_field(body, "instructions", str, None)
    new, cont = parse_input(body.get("input", _MISSING))
    messages = ([Message("system", instructions)] if instructions else []) + [*earlier, *new]
    if not messages:
        raise bad_request("'input' must hold at least one message", "input")
    try:
        text = render(
            messages, add_generation_prompt=not cont, continue_final_message=cont,
            open_think=tok.think_start is not None,
        )
    except TemplateError as e:
        raise bad_request(str(e), "input") from None
    prompt_ids = tok.encode(text)
    gen = _generation(body, prompt_ids, limits)
    echo = {k: body.get(k, d) if body.get(k) is not None else d for k, d in _ECHO_DEFAULTS.items()}
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    echo["tools"] = tools
    echo["tool_choice"] = body.get("tool_choice") or ("auto" if tools else "none")
    echo["parallel_tool_calls"] = optional_field(body, "parallel_tool_calls", bool, True)
    return ResponsesRequest(
        gen=gen,
        messages=tuple(messages),
        prompt_text=text,
        response_id=response_id,
        store=optional_field(body, "store", bool, True),
        previous_response_id=optional_field(body, "previous_response_id", str, None),
        enable_response_messages=optional_field(body, "enable_response_messages", bool, False),
        echo=echo,
    )


class _Missing:
    pass


_MISSING = _Missing()


def parse_input(raw: object) -> tuple[list[Message], bool]:
    """``input`` -> (messages, continue the last one)."""
    if isinstance(raw, _Missing):
        raise bad_request("Field required: 'input'", "input")
    if isinstance(raw, str):
        return [Message("user", raw)], False
    if not isinstance(raw, list):
        raise bad_request("'input' must be a string or a list of input items", "input")
    out: list[Message] = []
    for i, item in enumerate(raw):
        msg = _item(item, i)
        if msg is not None:
            out.append(msg)
    last = raw[-1] if raw else None
    cont = (
        isinstance(last, Mapping) and last.get("role") == "assistant"
        and last.get("status") in ("in_progress", "incomplete")
    )  # fmt: skip
    return out, bool(cont)


def _item(item: object, i: int) -> Message | None:
    if not isinstance(item, Mapping):
        raise bad_request(f"input[{i}] must be an object", "input")
    kind = item.get("type", "message")
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise bad_request(f"input[{i}].output must be a string", "input")
        return Message("tool", output)
    if kind in ("reasoning", "function_call"):
        return None  # the toy template renders neither (nor does chat here)
    if kind != "message":
        raise bad_request(f"Unsupported input item type: {kind}", "input")  # vLLM's wording
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"input[{i}].role must be one of {sorted(_ROLES)}", "input")
    return Message(str(role), _content(item.get("content"), i, first_only=role == "assistant"))


def _content(content: object, i: int, *, first_only: bool) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of text parts", "input")
    texts: list[str] = []
    for part in content:
        if (
            not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):  # fmt: skip
            raise bad_request(
                f"input[{i}].content parts must be {{'type': 'input_text', 'text': ...}} "
                "(the sim's model reads text only)", "input",
            )  # fmt: skip
        texts.append(part["text"])
    # vLLM keeps an assistant item's first part only; text parts of other roles join.
    return (texts[0] if texts else "") if first_only else "".join(texts)


def _generation(body: Mapping[str, Any], prompt_ids: list[int], limits: Limits) -> GenRequest:
    if len(prompt_ids) >= limits.max_model_len:
        raise bad_request(  # vLLM's wording (OpenAIServingResponses._validate_generator_input)
            f"The engine prompt length {len(prompt_ids)} exceeds the max_model_len "
            f"{limits.max_model_len}. Please reduce prompt.", "input",
        )  # fmt: skip
    room = limits.max_model_len - len(prompt_ids)
    requested = optional_field(body, "max_output_tokens", int, None)
    if requested is not None and requested < 1:
        raise bad_request(
            f"max_output_tokens must be at least 1, got {requested}.", "max_output_tokens"
        )
    max_tokens = min(limits.default_max_tokens if requested is None else requested, room)
    fields = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "min_tokens",
              "include_stop_str_in_output", "stream", "skip_special_tokens")  # fmt: skip
    shared = {k: body[k] for k in fields if k in body}
    gen = build_gen_request(shared, "chat", prompt_ids, max_tokens, limits)
    return gen


def sampling_echo(params: SamplingParams) -> dict[str, Any]:
    """The sampling fields a response object reports (the values used, defaults applied)."""
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_output_tokens": params.max_tokens,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": None,
    }


def not_found(response_id: str) -> ApiError:
    """vLLM's answer for an id it does not hold (_make_not_found_error)."""
    return ApiError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error",
        "response_id",
    )  # fmt: skip
