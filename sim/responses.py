"""OpenAI/vLLM response and SSE chunk shapes (pure dict builders + SSE framing).

Placement of the vLLM ``return_token_ids`` fields (vLLM >= 0.10.2):
* chat: ``prompt_token_ids`` at the TOP level of the first (role) chunk of each
  choice and of the non-streaming response; ``token_ids`` on each choice.
* completions: ``prompt_token_ids`` and ``token_ids`` both on the choice; the
  prompt ids only on the first chunk of each choice.
``finish_reason`` rides on the chunk of the last token (as vLLM does), and
``system_fingerprint`` only on terminal chunks (the finish chunk, or the usage
chunk when include_usage is on), as in current vLLM. With
``stream_options.continuous_usage_stats`` every chunk also carries ``usage``: the
prompt and the choice's tokens so far (0 on the role chunk), as vLLM's chat does
(``completion_tokens_details`` null: the sim counts no reasoning tokens).
``prompt_logprobs``, when requested, rides on each completions choice: [null,
{"<id>": {"logprob", "rank", "decoded_token"}}, ...].

Chat on a reasoning sim (``Meta.reasoning``): streamed deltas come from
sim.reasoning (``{"reasoning": ...}`` / ``{"content": ...}`` / both / ``{}``),
and the message gets ``reasoning`` next to ``content`` (null when absent).

Chat through the hermes tool parser (``Meta.tools``, sim.tools): streamed
deltas may carry ``tool_calls``, and the message gets the parsed calls in
``tool_calls`` (``[{"id", "type": "function", "function": {"name",
"arguments"}}]``), the text before the first ``<tool_call>`` as content
(null when blank), and finish_reason "tool_calls" when there are calls.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from sim import tools
from sim.reasoning import extract
from sim.scoring import Scored

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Meta:
    id: str
    created: int
    model: str
    fingerprint: str
    chat: bool
    return_token_ids: bool
    include_usage: bool
    role: str = "assistant"
    # stream_options.continuous_usage_stats: every chunk carries the usage so far
    continuous_usage: bool = False
    reasoning: bool = False  # chat through the deepseek_r1 reasoning parser
    include_reasoning: bool = True
    tools: bool = False  # chat through the tool parser (the request offers tools)
    tool_format: str = "hermes"  # which parser (--tool-call-parser)
    tool_defs: tuple[Any, ...] = ()  # the request's tools (qwen3_xml reads their types)

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    text: str
    token_ids: Sequence[int]
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: dict[str, Any] | None = None  # the choice's sampled-token logprobs (sim.logprobs)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(meta: Meta, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": meta.chunk_object,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    }


def role_chunk(meta: Meta, index: int, prompt_ids: Sequence[int]) -> dict[str, Any]:
    """Chat only: the first chunk of each choice."""
    chunk = _chunk(
        meta,
        {
            "index": index,
            "delta": {"role": meta.role, "content": ""},
            "logprobs": None,
            "finish_reason": None,
        },
    )
    if meta.continuous_usage:
        chunk["usage"] = stream_usage(len(prompt_ids), 0)
    if meta.return_token_ids:
        chunk["prompt_token_ids"] = prompt_ids
    return chunk


def token_chunk(
    meta: Meta,
    index: int,
    text: str,
    token_ids: Sequence[int],
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    prompt_ids: Sequence[int] | None = None,
    delta: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One generated token (or the abort marker when token_ids is empty).

    Chat: ``delta`` replaces the plain ``{"content": text}`` (reasoning parser).
    ``usage``: the chunk's continuous usage (stream_usage), when the request asked for it.
    """
    if meta.chat:
        choice: dict[str, Any] = {
            "index": index, "delta": {"content": text} if delta is None else delta
        }
    else:
        choice = {"index": index, "text": text}
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if meta.return_token_ids:
        if prompt_ids is not None and not meta.chat:
            choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = token_ids
    chunk = _chunk(meta, choice)
    if usage is not None:
        chunk["usage"] = usage
    if finish_reason is not None and not meta.include_usage:
        chunk["system_fingerprint"] = meta.fingerprint
    return chunk


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def stream_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A chunk's continuous usage, as vLLM sets it (its field order; the details null)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "completion_tokens_details": None,
    }


def usage_chunk(meta: Meta, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": meta.chunk_object,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": meta.fingerprint,
    }


def error_body(message: str, type_: str = "InternalServerError", code: int = 500) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def error_event(message: str, type_: str = "InternalServerError", code: int = 500) -> bytes:
    """vLLM's in-stream error (engine died mid-generation); followed by [DONE]."""
    return sse(error_body(message, type_, code))


PromptLogprobs = list[dict[str, dict[str, Any]] | None]


def prompt_logprobs(
    scored: Sequence[tuple[Scored, ...] | None], texts: Sequence[str]
) -> PromptLogprobs:
    """vLLM's wire shape: one dict per position keyed by str(token id), null first."""
    def one(s: Scored) -> dict[str, Any]:
        return {"logprob": s.logprob, "rank": s.rank, "decoded_token": texts[s.token_id]}

    return [
        None if entry is None else {str(s.token_id): one(s) for s in entry} for entry in scored
    ]


def full_response(
    meta: Meta,
    prompt_ids: Sequence[int],
    results: Sequence[ChoiceResult],
    prompt_logprobs: PromptLogprobs | None = None,
) -> dict[str, Any]:
    """Non-streaming body for chat or completions."""
    choices: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        if meta.chat:
            message: dict[str, Any] = {"role": meta.role, "content": r.text, "tool_calls": []}
            if meta.reasoning:
                reasoning, message["content"] = extract(r.text)
                message["reasoning"] = reasoning if meta.include_reasoning else None
            finish = r.finish_reason
            if meta.tools:
                content, message["tool_calls"] = tools.extract(
                    message["content"] or "", meta.tool_format, meta.tool_defs
                )
                if message["tool_calls"]:
                    message["content"], finish = content, "tool_calls"
            choice: dict[str, Any] = {"index": i, "message": message}
        else:
            finish = r.finish_reason
            choice = {"index": i, "text": r.text}
        choice["logprobs"] = r.logprobs
        choice["finish_reason"] = finish
        choice["stop_reason"] = r.stop_reason
        if meta.return_token_ids:
            if not meta.chat:
                choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = r.token_ids
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    body: dict[str, Any] = {
        "id": meta.id,
        "object": "chat.completion" if meta.chat else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage(len(prompt_ids), sum(len(r.token_ids) for r in results)),
        "system_fingerprint": meta.fingerprint,
    }
    if meta.chat and meta.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body
