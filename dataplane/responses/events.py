"""A Responses API event stream written by the shim, in vLLM's shapes and order
(vllm/entrypoints/openai/responses/streaming_events.py, the simple path): created and
in_progress, then per output item its added / part added / deltas / text done / part done /
item done (a function call's: added / arguments deltas / arguments done / item done), then
one response.completed carrying the whole response, its output the items as streamed (or
response.failed).
`sequence_number` rises by one per event from 0; each item keeps its `item_id`,
`output_index` and `content_index` however many backends its text came from."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

# Echoed from the request into the response object, as vLLM echoes them.
ECHOED = ("instructions", "metadata", "max_output_tokens", "previous_response_id", "temperature",
          "top_p", "user", "top_logprobs")  # fmt: skip


def skeleton(body: Mapping[str, Any], response_id: str, created_at: int) -> dict[str, Any]:
    """The response object before any output (status in_progress)."""
    obj: dict[str, Any] = {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": None,
        "model": body["model"],
        "object": "response",
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        # vLLM's check_tool_usage: without tools, tool_choice auto (its default) is none.
        "tool_choice": body.get("tool_choice", "auto") if body.get("tools") else "none",
        "tools": body.get("tools") or [],
        "background": False,
        "service_tier": body.get("service_tier", "auto"),
        "status": "in_progress",
        "text": body.get("text") or {"format": {"type": "text"}},
        "truncation": body.get("truncation", "disabled"),
        "usage": None,
    }
    for name in ECHOED:
        obj[name] = body.get(name)
    return obj


BLOCK = 256  # deltas of an item's text joined into one str (_Item.add)


@dataclass(slots=True)
class _Item:
    kind: str  # "message" | "reasoning" | "function_call"
    item_id: str
    output_index: int
    text: list[str] = field(default_factory=list)  # a function call's: its arguments
    call: tuple[int, str, str] | None = None  # a function call's chat index, call_id, name
    loose: int = 0  # the latest pieces of `text` not yet joined into a block

    def add(self, piece: str) -> None:
        """One delta's text, kept for the item's done event: joined every BLOCK deltas, so a
        long answer is not one str object per token."""
        self.text.append(piece)
        self.loose += 1
        if self.loose >= BLOCK:
            self.text[-BLOCK:] = ["".join(self.text[-BLOCK:])]
            self.loose = 0


class ResponseEvents:
    def __init__(self, response: dict[str, Any], new_id: Any) -> None:
        """`new_id(prefix)`: a fresh id for an output item ("msg_…", "rs_…", "fc_…")."""
        self._response = response
        self._new_id = new_id
        self._seq = 0
        self._item: _Item | None = None
        self._output: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self) -> bytes:
        return self._event("response.created", response=self._response) + self._event(
            "response.in_progress", response=self._response
        )

    def delta(self, kind: str, text: str) -> bytes:
        """Text of an output item of `kind` ("message" or "reasoning"); opens the item (and
        closes the other kind's) as vLLM does."""
        out = b""
        item = self._item
        if item is None or item.kind != kind:
            out += self._close()
            out += self._open(kind)
            item = self._item
            assert item is not None
        item.add(text)
        where = {"item_id": item.item_id, "output_index": item.output_index, "content_index": 0}
        if kind == "reasoning":
            return out + self._event("response.reasoning_text.delta", **where, delta=text)
        return out + self._event("response.output_text.delta", **where, delta=text, logprobs=[])

    def call(self, index: int, call_id: str, name: str, arguments: str) -> bytes:
        """A tool call's delta (the chat stream's `index`; `call_id` and `name` are read when
        it opens): a call of another index closes the open item and opens a function_call
        item, as vLLM's SimpleStreamingEventProcessor does; its arguments go out as
        function_call_arguments deltas."""
        out = b""
        item = self._item
        if item is None or item.call is None or item.call[0] != index:
            out += self._close()
            item = _Item("function_call", self._new_id("fc"), len(self._output),
                         call=(index, call_id, name))  # fmt: skip
            self._item = item
            added = {"type": "function_call", "id": item.item_id, "call_id": call_id,
                     "name": name, "arguments": "", "status": "in_progress"}  # fmt: skip
            out += self._event("response.output_item.added", output_index=item.output_index,
                               item=added)  # fmt: skip
        if not arguments:
            return out
        item.add(arguments)
        return out + self._event("response.function_call_arguments.delta",
                                 output_index=item.output_index, item_id=item.item_id,
                                 delta=arguments)  # fmt: skip

    def _open(self, kind: str) -> bytes:
        item = _Item(kind, self._new_id("rs" if kind == "reasoning" else "msg"), len(self._output))
        self._item = item
        where = {"output_index": item.output_index}
        if kind == "reasoning":
            added = {"type": "reasoning", "id": item.item_id, "summary": [],
                     "status": "in_progress"}  # fmt: skip
            part: dict[str, Any] = {"text": "", "type": "reasoning_text"}
        else:
            added = {"id": item.item_id, "type": "message", "role": "assistant", "content": [],
                     "status": "in_progress"}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._event("response.output_item.added", **where, item=added) + self._event(
            "response.content_part.added", **where, item_id=item.item_id, content_index=0,
            part=part,
        )  # fmt: skip

    def _close(self) -> bytes:
        item, self._item = self._item, None
        if item is None:
            return b""
        if item.call is not None:
            return self._close_call(item)
        text = "".join(item.text)
        where = {"item_id": item.item_id, "output_index": item.output_index, "content_index": 0}
        if item.kind == "reasoning":
            part: dict[str, Any] = {"text": text, "type": "reasoning_text"}
            done = {"type": "reasoning", "content": [part], "status": "completed",
                    "id": item.item_id, "summary": []}  # fmt: skip
            first = self._event("response.reasoning_text.done", **where, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
            done = {"id": item.item_id, "type": "message", "role": "assistant",
                    "content": [part] if text else [], "status": "completed"}  # fmt: skip
            first = self._event("response.output_text.done", **where, text=text, logprobs=[])
        self._output.append(done)
        return (
            first
            + self._event("response.content_part.done", **where, part=part)
            + self._event("response.output_item.done", output_index=item.output_index, item=done)
        )

    def _close_call(self, item: _Item) -> bytes:
        assert item.call is not None
        _, call_id, name = item.call
        arguments = "".join(item.text)
        done = {"type": "function_call", "name": name, "arguments": arguments,
                "status": "completed", "id": item.item_id, "call_id": call_id}  # fmt: skip
        self._output.append(done)
        where = {"output_index": item.output_index, "item_id": item.item_id}
        return self._event(
            "response.function_call_arguments.done", **where, arguments=arguments, name=name
        ) + self._event("response.output_item.done", output_index=item.output_index, item=done)

    def completed(self, finish: str | None, usage: Mapping[str, Any] | None) -> bytes:
        """Closes the open item and ends the stream with the whole response."""
        out = self._close()
        response = {**self._response, "output": self._output, "usage": _usage(usage)}
        if finish == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        return out + self._event("response.completed", response=response)

    def failed(self, message: str) -> bytes:
        """Ends the stream with response.failed: the output so far, and why it stopped."""
        out = self._close()
        response = {**self._response, "output": self._output, "status": "failed",
                    "error": {"code": "server_error", "message": message}}  # fmt: skip
        return out + self._event("response.failed", response=response)


def _usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A chat usage object in the Responses API's names."""
    if not usage:
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(details.get("cached_tokens") or 0)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def failed_event(created: dict[str, Any] | None, seq: int, message: str) -> bytes:
    """response.failed for the response the engine announced (an `error` event when it
    announced none): how a Responses stream the shim must cut ends."""
    error = {"code": "server_error", "message": message}
    if created is None:
        data: dict[str, Any] = {"type": "error", **error, "param": None, "sequence_number": seq}
    else:
        response = {**created, "status": "failed", "error": error}
        data = {"type": "response.failed", "sequence_number": seq, "response": response}
    kind: str = data["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
