"""The client's stream of a Messages request served as chat (request.as_chat): what the relay
writes (the stitched chat chunks, whichever backends they came from; an SSE error event;
[DONE]) goes to the client as Anthropic events (events.py). The relay and its failover know
nothing of the Messages API; this is the only place the two formats meet."""

# baton: pure

from __future__ import annotations

import orjson

from dataplane.messages.events import MessageEvents, error_event
from dataplane.sse import ClientStream, SSEParser


class ChatAsMessages:
    def __init__(self, out: ClientStream, events: MessageEvents) -> None:
        self._out = out
        self._events = events
        self._parser = SSEParser()
        self._ended = False
        self.failed = False  # the stream ended in an error event

    async def write(self, data: bytes) -> None:
        out = b""
        for ev in self._parser.feed(data):
            if not ev.data or self._ended:
                continue
            if ev.is_done:
                self._ended = True
                out += self._events.done()
                continue
            obj = orjson.loads(ev.data)
            error = obj.get("error")
            if isinstance(error, dict):  # the relay's explicit end (OpenAIError.sse)
                # Anthropic's own end of a failed stream: no message_stop follows.
                self._ended = self.failed = True
                out += error_event("api_error", str(error.get("message", "")))
                continue
            out += self._events.chunk(obj)
        if out:
            await self._out.write(out)
