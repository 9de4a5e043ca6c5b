"""The client's stream of a Responses request served as chat (request.as_chat): what the
relay writes (the stitched chat chunks, whichever backends they came from, an SSE error event,
[DONE]) goes to the client as Responses events (events.py): a delta's reasoning, then its
content, then its tool calls, as vLLM splits a delta. The relay and its failover know
nothing of the Responses API; this is the only place the two formats meet."""

# baton: pure

from __future__ import annotations

import uuid
from typing import Any

import orjson

from dataplane.responses.events import ResponseEvents
from dataplane.sse import ClientStream, SSEParser


class ChatAsResponses:
    def __init__(self, out: ClientStream, events: ResponseEvents) -> None:
        self._out = out
        self._events = events
        self._parser = SSEParser()
        self._started = False
        self._ended = False
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self.failed = False  # the stream ended in response.failed

    async def write(self, data: bytes) -> None:
        out = b""
        if not self._started:
            self._started = True
            out += self._events.start()
        for event in self._parser.feed(data):
            if not event.data or self._ended:
                continue
            if event.is_done:
                self._ended = True
                out += self._events.completed(self._finish, self._usage)
                continue
            out += self._chunk(orjson.loads(event.data))
        if out:
            await self._out.write(out)

    def _chunk(self, obj: dict[str, Any]) -> bytes:
        error = obj.get("error")
        if isinstance(error, dict):  # the relay's explicit end (OpenAIError.sse)
            self._ended = self.failed = True
            return self._events.failed(str(error.get("message", "")))
        if obj.get("usage"):
            self._usage = obj["usage"]
        out = b""
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                out += self._events.delta("reasoning", reasoning)
            if delta.get("content"):
                out += self._events.delta("message", delta["content"])
            out += self._calls(delta.get("tool_calls") or ())
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def _calls(self, calls: Any) -> bytes:
        """A delta's tool calls, grouped by index in order of first appearance (vLLM's
        split_delta): each group's arguments go out together, under its first call's id and
        name when it opens an item."""
        groups: dict[int, list[dict[str, Any]]] = {}
        for call in calls:
            if isinstance(call, dict) and call.get("function") is not None:
                groups.setdefault(int(call.get("index") or 0), []).append(call)
        out = b""
        for index, group in groups.items():
            first = group[0]
            name = str(first["function"].get("name") or "")
            call_id = str(first.get("id") or f"chatcmpl-tool-{uuid.uuid4().hex[:16]}")
            args = "".join(c["function"].get("arguments") or "" for c in group)
            out += self._events.call(index, call_id, name, args)
        return out
