"""The client's answer to a request the shim generates itself (speculative rounds), in the
client's own format: chat or completion, streamed as SSE or whole, with usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from dataplane.exceptions import OpenAIError
from dataplane.request import ClientRequest, Endpoint
from dataplane.sse import DONE_EVENT, sse

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class AnswerWriter:
    """The client's answer in its own format, streamed or whole."""

    def __init__(self, request: web.Request, client: ClientRequest, request_id: str) -> None:
        self._request = request
        self._client = client
        self._chat = client.endpoint is Endpoint.CHAT
        prefix = "chatcmpl-" if self._chat else "cmpl-"
        self._id = prefix + uuid.uuid4().hex
        self._created = int(time.time())
        self._request_id = request_id
        self._parts: list[str] = []
        self._stream: web.StreamResponse | None = None
        self.response: web.StreamResponse = web.Response(status=500)

    async def _open(self) -> web.StreamResponse:
        if self._stream is None:
            self._stream = web.StreamResponse(
                status=200, headers={**SSE_HEADERS, "X-Request-Id": self._request_id}
            )
            await self._stream.prepare(self._request)
            self.response = self._stream
            if self._chat:
                await self._stream.write(sse(self._chunk({"role": "assistant", "content": ""})))
        return self._stream

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None = None) -> dict[str, Any]:
        if self._chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}  # fmt: skip
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": self._id, "object": obj, "created": self._created,
                "model": self._client.model, "choices": [choice]}  # fmt: skip

    async def text(self, delta: str) -> None:
        if not self._client.stream:
            self._parts.append(delta)
            return
        stream = await self._open()
        await stream.write(sse(self._chunk({"content": delta} if self._chat else delta)))

    async def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
        if not self._client.stream:
            text = "".join(self._parts)
            if self._chat:
                choice: dict[str, Any] = {
                    "index": 0, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": reason,
                }  # fmt: skip
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
                obj = "text_completion"
            body = {"id": self._id, "object": obj, "created": self._created,
                    "model": self._client.model, "choices": [choice], "usage": usage}  # fmt: skip
            self.response = web.Response(
                body=orjson.dumps(body),
                content_type="application/json",
                headers={"X-Request-Id": self._request_id},
            )
            return
        stream = await self._open()
        await stream.write(sse(self._chunk({} if self._chat else "", reason)))
        options = self._client.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            last = self._chunk({} if self._chat else "")
            last["choices"] = []
            last["usage"] = usage
            await stream.write(sse(last))
        await stream.write(DONE_EVENT)
        await stream.write_eof()

    async def fail(self, err: OpenAIError) -> None:
        if self._stream is None and not self._client.stream:
            self.response = web.Response(
                body=err.json(), status=err.status, content_type="application/json"
            )
            return
        stream = await self._open()
        await stream.write(b"data: " + err.json() + b"\n\n")
        await stream.write(DONE_EVENT)
        await stream.write_eof()
