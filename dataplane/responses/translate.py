"""The client's stream of a Responses request served as chat (request.as_chat): what the
relay writes (the stitched chat chunks, whichever backends they came from, an SSE error event,
[DONE]) goes to the client as Responses events (events.py). The relay and its failover know
nothing of the Responses API; this is the only place the two formats meet."""

# baton: pure

from __future__ import annotations

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
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out
