"""Responses API shapes as vLLM 0.32 sends them: the response object, items, SSE events (pure).

A stream (vLLM responses/serving.py ``responses_stream_generator`` and
streaming_events.py, simple path without a parser) is

    response.created, response.in_progress            (status "in_progress", output [])
    response.output_item.added, response.content_part.added    (at the first text)
    response.output_text.delta ...                    (one per token that releases text)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed                                (status "completed" or "incomplete")

each framed ``event: <type>\\ndata: <json>\\n\\n``, with ``sequence_number`` counting
from 0, and no ``data: [DONE]`` at the end. A generation that releases no text
opens no item (the final output is then ``[]``). ``response.completed`` is sent
even when max_output_tokens ended the response: its status is then "incomplete"
with ``incomplete_details: {"reason": "max_output_tokens"}``.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from sim.responses_api import ResponsesRequest, sampling_echo


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0


def usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.input_tokens,
        "input_tokens_details": {
            "cached_tokens": u.cached_tokens,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": u.output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": u.input_tokens + u.output_tokens,
    }


def output_text(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message item; no content part when the text is empty (as vLLM)."""
    return {
        "id": item_id,
        "content": [output_text(text)] if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def response_object(
    req: ResponsesRequest,
    *,
    model: str,
    created_at: int,
    status: str,
    output: Sequence[dict[str, Any]] = (),
    use: Usage | None = None,
    messages: tuple[list[int], str] | None = None,
) -> dict[str, Any]:
    """vLLM's ResponsesResponse.from_request. ``messages``: the output's (token ids,
    text), reported with the prompt's as input/output_messages when the request
    set enable_response_messages."""
    body: dict[str, Any] = {
        "id": req.response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "object": "response",
        "output": list(output),
        "background": False,
        "previous_response_id": req.previous_response_id,
        "status": status,
        "usage": None if use is None else usage(use),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }
    body.update(req.echo)
    body.update(sampling_echo(req.gen.params))
    if req.enable_response_messages and messages is not None:
        ids, text = messages
        body["input_messages"] = [{"message": req.prompt_text, "tokens": req.gen.prompt_ids}]
        body["output_messages"] = [{"message": text, "tokens": ids}] if ids or text else None
    return body


def final_status(finish_reason: str | None) -> str:
    """vLLM's simple path: "incomplete" only for the length limit; everything else,
    an abort included, is "completed"."""
    return "incomplete" if finish_reason == "length" else "completed"


class EventWriter:
    """Numbers and frames one stream's events (mutable, one per stream)."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0

    def event(self, type_: str, **fields: Any) -> bytes:
        obj = {**fields, "sequence_number": self.seq, "type": type_}
        self.seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

    def start(self, initial: dict[str, Any]) -> list[bytes]:
        return [
            self.event("response.created", response=initial),
            self.event("response.in_progress", response=initial),
        ]

    def open_message(self, item_id: str) -> list[bytes]:
        return [
            self.event("response.output_item.added", item=message_item(item_id, "", "in_progress"),
                       output_index=0),
            self.event("response.content_part.added", content_index=0, item_id=item_id,
                       output_index=0, part=output_text("", [])),
        ]  # fmt: skip

    def delta(self, item_id: str, text: str) -> bytes:
        return self.event("response.output_text.delta", content_index=0, delta=text,
                          item_id=item_id, logprobs=[], output_index=0)  # fmt: skip

    def close_message(self, item_id: str, text: str) -> list[bytes]:
        return [
            self.event("response.output_text.done", content_index=0, item_id=item_id,
                       logprobs=[], output_index=0, text=text),
            self.event("response.content_part.done", content_index=0, item_id=item_id,
                       output_index=0, part=output_text(text)),
            self.event("response.output_item.done", item=message_item(item_id, text),
                       output_index=0),
        ]  # fmt: skip

    def completed(self, final: dict[str, Any]) -> bytes:
        return self.event("response.completed", response=final)
