"""Chat responses as vLLM 0.32 turns them into Messages API responses (pure).

vLLM serves /v1/messages with its chat server and converts what comes out
(entrypoints/anthropic/serving.py): ``message`` is ``messages_full_converter``
over a chat completion body, ``StreamConverter`` is ``message_stream_converter``
over a chat stream (the one sim.messages_api asked for: include_usage and
continuous_usage_stats on). A stream is

    message_start            (on the first chunk, whatever it holds: the role chunk;
                              usage {input_tokens: prompt, output_tokens: 0})
    content_block_start      (a block opens when the kind of delta changes:
    content_block_delta ...   thinking <- reasoning, text <- content,
    content_block_stop        tool_use <- a tool call with a name)
    message_delta            (on the usage chunk: stop_reason, stop_sequence, usage)
    message_stop             (on [DONE])

each framed ``event: <type>\\ndata: <json>\\n\\n`` (no ``[DONE]``, no ``ping``).
A thinking block ends with a ``signature_delta`` (a random hex signature); text
that arrives while a tool_use block is open is held and sent as its own text
block when that block closes; empty deltas open nothing, so a generation with no
text has no content block at all (the non-streamed message then holds one empty
text block). Block indexes count from 0.

A chunk that is not a chat chunk (an in-band ``{"error": ...}`` chunk) fails vLLM's
validation of ChatCompletionStreamResponse: the stream ends there with an
``event: error`` of type "internal_error" whose message is pydantic's text about
the missing fields; no content_block_stop, message_delta or message_stop follow.

stop_reason: "length" -> "max_tokens"; "stop" with a matched stop string ->
"stop_sequence" (and stop_sequence is the string); "tool_calls", or "stop" after a
tool_use block -> "tool_use"; "stop" -> "end_turn"; anything else ("abort") -> null.
"""

# baton: pure

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

Signature = Callable[[], str]  # a thinking block's signature (vLLM: uuid4().hex)
PYDANTIC_DOCS = "https://errors.pydantic.dev/2.14/v/"  # the pydantic vLLM 0.32 ships with


def stop_reason(
    finish: str | None, stop: object, *, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """vLLM's _to_anthropic_stop_reason: (stop_reason, stop_sequence)."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def usage(chat_usage: Mapping[str, Any] | None) -> dict[str, int]:
    """vLLM's _build_anthropic_usage: cached prompt tokens are not input_tokens."""
    if chat_usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    out = {"input_tokens": chat_usage["prompt_tokens"],
           "output_tokens": chat_usage.get("completion_tokens") or 0}  # fmt: skip
    details = chat_usage.get("prompt_tokens_details") or {}
    for src, dst in (("created_cache_tokens", "cache_creation_input_tokens"),
                     ("cached_tokens", "cache_read_input_tokens")):  # fmt: skip
        if details.get(src) is not None:
            out["input_tokens"] -= details[src]
            out[dst] = details[src]
    out["input_tokens"] = max(0, out["input_tokens"])
    return out


def message(chat: Mapping[str, Any], signature: Signature) -> dict[str, Any]:
    """A non-streamed chat completion as a Messages API message (null fields left out)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    reason, sequence = stop_reason(
        choice["finish_reason"], choice.get("stop_reason"),
        tool_used=bool(calls), tool_complete=bool(calls),
    )  # fmt: skip
    content: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": signature()})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in calls:
        fn = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"],
                        "input": json.loads(fn["arguments"])})  # fmt: skip
    body: dict[str, Any] = {
        "id": chat["id"], "type": "message", "role": "assistant",
        "content": content or [{"type": "text", "text": ""}], "model": chat["model"],
    }  # fmt: skip
    if reason is not None:
        body["stop_reason"] = reason
    if sequence is not None:
        body["stop_sequence"] = sequence
    body["usage"] = usage(chat.get("usage"))
    return body


def error_body(type_: str, message: str) -> dict[str, Any]:
    """vLLM's AnthropicErrorResponse (translate_error_response keeps the OpenAI type)."""
    return {"type": "error", "error": {"type": type_, "message": message}}


def event(kind: str, data: Mapping[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class StreamConverter:
    """vLLM's message_stream_converter over one chat stream's bytes. Mutable."""

    def __init__(self, signature: Signature) -> None:
        self._signature = signature
        self._buf = b""
        self.ended = False  # an error event went out: the rest is dropped
        self._first = True
        self._finish: str | None = None
        self._stop: object = None
        self._tool_used = False
        self._tool_args: list[str] = []  # the latest tool_use block's arguments
        self._tool_ids: dict[int, str] = {}
        self._next = 0  # the next block's index
        self._kind: str | None = None  # the open block's type
        self._at: int | None = None  # the open block's index
        self._sig: str | None = None  # an open thinking block's signature, until sent
        self._tool_id: str | None = None  # an open tool_use block's id
        self._pending: list[str] = []  # text that came while a tool_use block was open

    def feed(self, data: bytes) -> bytes:
        """The Messages events for these chat stream bytes (whole frames; a tail waits)."""
        self._buf += data
        out: list[bytes] = []
        while not self.ended and (end := self._buf.find(b"\n\n")) >= 0:
            frame, self._buf = self._buf[:end], self._buf[end + 2 :]
            out.extend(self._frame(frame.decode("utf-8", "replace")))
        return b"".join(out)

    def _frame(self, item: str) -> list[bytes]:
        if not item.startswith("data:"):
            return [event("error", error_body("internal_error", "Invalid data format received"))]
        data = item[5:].strip()
        if data == "[DONE]":
            return [*self._flush(), event("message_stop", {"type": "message_stop"})]
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as e:  # never from the sim's own chat stream
            self.ended = True
            return [event("error", error_body("internal_error", _sanitize(str(e))))]
        missing = [f for f in ("model", "choices") if not isinstance(chunk, dict) or f not in chunk]
        if missing:
            self.ended = True
            return [event("error", error_body("internal_error", _not_a_chunk(chunk, missing)))]
        if self._first:
            self._first = False
            return [event("message_start", {"type": "message_start", "message": {
                "id": chunk.get("id"), "type": "message", "role": "assistant", "content": [],
                "model": chunk["model"], "stop_reason": None, "stop_sequence": None,
                "usage": usage(chunk.get("usage")),
            }})]  # fmt: skip
        if not chunk["choices"]:
            complete = self._tool_used and _is_json("".join(self._tool_args))
            reason, sequence = stop_reason(
                self._finish or "stop",
                self._stop,
                tool_used=self._tool_used,
                tool_complete=complete,
            )
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            return [*self._flush(), event("message_delta", {
                "type": "message_delta", "delta": delta, "usage": usage(chunk.get("usage")),
            })]  # fmt: skip
        return self._choice(chunk["choices"][0])

    def _choice(self, choice: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if choice.get("finish_reason") is not None:
            self._finish, self._stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        if delta.get("reasoning"):
            if self._kind != "thinking":
                out += self._flush()
                out.append(self._open({"type": "thinking", "thinking": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self._kind == "tool_use":
                self._pending.append(delta["content"])
            else:
                if self._kind != "text":
                    out += self._flush()
                    out.append(self._open({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            out += self._tool_call(call)
        return out

    def _tool_call(self, call: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        fn = call.get("function") or {}
        if call.get("id") is not None:
            self._tool_ids[call["index"]] = call["id"]
            if self._tool_id != call["id"] and fn.get("name") is not None:
                out += self._flush()
                self._tool_used, self._tool_args = True, []
                out.append(self._open({"type": "tool_use", "id": call["id"], "name": fn["name"],
                                       "input": {}}))  # fmt: skip
            target: str | None = call["id"]
        else:
            target = self._tool_ids.get(call["index"])
        if target is not None and fn.get("arguments") and self._tool_id == target:
            self._tool_args.append(fn["arguments"])
            out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    # -- blocks ------------------------------------------------------------------------
    def _open(self, block: dict[str, Any]) -> bytes:
        self._kind, self._at = block["type"], self._next
        self._sig = self._signature() if block["type"] == "thinking" else None
        self._tool_id = block.get("id")
        return event(
            "content_block_start",
            {"type": "content_block_start", "content_block": block, "index": self._next},
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        at = self._at if self._at is not None else self._next
        return event("content_block_delta", {"type": "content_block_delta", "delta": delta,
                                             "index": at})  # fmt: skip

    def _close(self) -> list[bytes]:
        if self._kind is None:
            return []
        out = []
        if self._sig is not None:
            out.append(self._delta({"type": "signature_delta", "signature": self._sig}))
        out.append(event("content_block_stop", {"type": "content_block_stop", "index": self._at}))
        self._kind = self._at = self._sig = self._tool_id = None
        self._next += 1
        return out

    def _flush(self) -> list[bytes]:
        """vLLM's stop_and_flush: close the open block; held text becomes a text block."""
        held, self._pending = "".join(self._pending), []
        out = self._close()
        if held:
            out.append(self._open({"type": "text", "text": ""}))
            out.append(self._delta({"type": "text_delta", "text": held}))
            out += self._close()
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _not_a_chunk(value: object, missing: list[str]) -> str:
    """str(pydantic.ValidationError) for a ChatCompletionStreamResponse missing fields,
    through vLLM's sanitize_message."""
    shown = repr(value)
    if len(shown) > 50:  # pydantic-core truncates the input's repr
        shown = shown[:25] + "..." + shown[-24:]
    label = "error" if len(missing) == 1 else "errors"
    lines = [f"{len(missing)} validation {label} for ChatCompletionStreamResponse"]
    for name in missing:
        lines += [
            name,
            f"  Field required [type=missing, input_value={shown}, "
            f"input_type={type(value).__name__}]",
            f"    For further information visit {PYDANTIC_DOCS}missing",
        ]
    return _sanitize("\n".join(lines))


def _sanitize(message: str) -> str:
    """vLLM's sanitize_message: no memory addresses, traceback lines or file paths."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()
