"""The Anthropic stream events of a message Baton writes itself (a replayable request served
as chat: dataplane/messages/translate.py), in vLLM 0.32's shapes and order
(vllm/entrypoints/anthropic/serving.py, message_stream_converter): `message_start` on the
first chat chunk, a `content_block_start` / `_delta` / `_stop` run per block (thinking, text,
tool_use with `input_json_delta` pieces of its arguments; a thinking block ends with its
`signature_delta`; text that comes while a tool_use block is open is held and sent as a text
block of its own once that block closes), `message_delta` with the stop reason
and the whole generation's usage on the usage chunk, `message_stop` on [DONE]. No `ping`:
vLLM sends none. Keys in the order vLLM's models serialise them."""

# baton: pure

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import orjson


def event(kind: str, data: Mapping[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(kind: str, message: str) -> bytes:
    """Anthropic's in-stream error: `event: error`, as its API (and vLLM) sends one."""
    return event("error", {"type": "error", "error": {"type": kind, "message": message}})


def usage_of(usage: Mapping[str, Any] | None) -> dict[str, int]:
    """A chat usage in Anthropic's terms (vLLM's _build_anthropic_usage): input tokens are
    the prompt's less what was read from or written to the cache, which are given apart
    only when the engine reports them."""
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    out = {"input_tokens": 0, "output_tokens": usage.get("completion_tokens") or 0}
    inputs = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        created = details.get("created_cache_tokens")
        read = details.get("cached_tokens")
        if created is not None:
            inputs -= created
            out["cache_creation_input_tokens"] = created
        if read is not None:
            inputs -= read
            out["cache_read_input_tokens"] = read
    out["input_tokens"] = max(0, inputs)
    return {"input_tokens": out.pop("input_tokens"), **out}


def stop_reason(
    finish: str | None, stop: object, *, tool_used: bool = False, tool_complete: bool = False
) -> tuple[str | None, str | None]:
    """A chat finish as Anthropic's (stop_reason, stop_sequence) (vLLM's
    _to_anthropic_stop_reason): max_tokens always wins; complete tool calls win over a
    matched stop string (a call a stop string cut short must not run)."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):  # a matched stop string; an int is a stop token id
        return "stop_sequence", stop
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _is_json(text: str) -> bool:
    """vLLM's _is_json: whether the last call's arguments parse (Python's json, as vLLM's)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class MessageEvents:
    """One message's events, fed the client's chat chunks in order. `signature`: a thinking
    block's signature (vLLM: a fresh uuid4 hex per block)."""

    def __init__(self, signature: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self._signature = signature
        self._started = False
        self._index = 0  # the next block's index
        self._open: str | None = None  # the open block's type
        self._tool_id: str | None = None  # the open tool_use block's id
        self._pending: list[str] = []  # text that came while a tool_use block was open
        self._tool_ids: dict[int, str] = {}  # a tool call's index -> its id
        self._tool_used = False
        self._last_args: list[str] = []  # the latest tool_use block's arguments
        self._finish: str | None = None
        self._stop: object = None
        self.stop_reason: str | None = None  # once the message ended
        self.usage: dict[str, int] | None = None

    def chunk(self, obj: Mapping[str, Any]) -> bytes:
        """The events for one chat chunk (an object with choices, or the usage chunk)."""
        if not self._started:
            # The first chunk announces the message; its content is not read (vLLM's role
            # chunk carries none), and its continuous usage counts the prompt.
            self._started = True
            message = {
                "id": obj.get("id", ""), "type": "message", "role": "assistant", "content": [],
                "model": obj.get("model", ""), "stop_reason": None, "stop_sequence": None,
                "usage": usage_of(obj.get("usage")),
            }  # fmt: skip
            return event("message_start", {"type": "message_start", "message": message})
        choices = obj.get("choices") or ()
        if not choices:
            return self._ending(obj.get("usage"))
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self._finish, self._stop = choice["finish_reason"], choice.get("stop_reason")
        delta = choice.get("delta") or {}
        out = b""
        # vLLM 0.32 names it `reasoning`; older engines' parsers `reasoning_content`.
        thought = delta.get("reasoning") or delta.get("reasoning_content")
        if thought:
            out += self._delta("thinking", {"type": "thinking_delta", "thinking": thought})
        text = delta.get("content")
        if text and self._open == "tool_use":
            self._pending.append(text)  # vLLM holds it until the tool_use block closes
        elif text:
            out += self._delta("text", {"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or ():
            out += self._tool_call(call)
        return out

    def done(self) -> bytes:
        """[DONE]: the message's end."""
        return self._flush() + event("message_stop", {"type": "message_stop"})

    def _delta(self, kind: str, delta: dict[str, Any]) -> bytes:
        out = b""
        if self._open != kind:
            out += self._flush()
            block = {"type": "thinking", "thinking": ""} if kind == "thinking" else {
                "type": "text", "text": ""}  # fmt: skip
            out += self._start(kind, block)
        return out + self._block("content_block_delta", "delta", delta)

    def _tool_call(self, call: Mapping[str, Any]) -> bytes:
        """One tool_calls delta as vLLM's converter reads it: a call with an id and a name
        opens a tool_use block; arguments go out as input_json_delta while their call's
        block is the open one (a parser streams calls one after another)."""
        function = call.get("function") or {}
        args = function.get("arguments")
        out = b""
        call_id = call.get("id")
        if call_id is not None:
            self._tool_ids[call.get("index", 0)] = call_id
            name = function.get("name")
            if self._tool_id != call_id and name is not None:
                out += self._flush()
                self._tool_used, self._last_args = True, []
                block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
                out += self._start("tool_use", block)
        else:
            call_id = self._tool_ids.get(call.get("index", 0))
        if call_id is not None and args and self._tool_id == call_id:
            self._last_args.append(args)
            partial = {"type": "input_json_delta", "partial_json": args}
            out += self._block("content_block_delta", "delta", partial)
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> bytes:
        self._open = kind
        self._tool_id = block["id"] if kind == "tool_use" else None
        return self._block("content_block_start", "content_block", block)

    def _block(self, kind: str, name: str, value: dict[str, Any]) -> bytes:
        """A block's event, its keys in vLLM's order (type, the delta or block, index)."""
        return event(kind, {"type": kind, name: value, "index": self._index})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":
            signature = {"type": "signature_delta", "signature": self._signature()}
            out += self._block("content_block_delta", "delta", signature)
        out += event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        self._open = self._tool_id = None
        self._index += 1
        return out

    def _flush(self) -> bytes:
        """Closes the open block; text held while a tool_use block was open follows as a
        text block of its own (vLLM's stop_and_flush)."""
        out = self._close()
        if self._pending:
            text, self._pending = "".join(self._pending), []
            out += self._start("text", {"type": "text", "text": ""})
            out += self._block("content_block_delta", "delta", {"type": "text_delta", "text": text})
            out += self._close()
        return out

    def _ending(self, usage: Mapping[str, Any] | None) -> bytes:
        out = self._flush()
        complete = self._tool_used and _is_json("".join(self._last_args))
        reason, sequence = stop_reason(
            self._finish or "stop", self._stop, tool_used=self._tool_used, tool_complete=complete
        )
        self.stop_reason, self.usage = reason, usage_of(usage)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return out + event(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage}
        )
