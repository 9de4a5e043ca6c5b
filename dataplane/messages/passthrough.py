"""A Messages stream relayed as the engine sends it: a request that cannot be replayed on
another engine (request.replay_refusal: tools, images, a thinking budget...). Its events go
to the client untouched. When the engine fails before `message_stop`, the stream cannot go
on elsewhere, so the client gets the Messages API's own end, an `error` event saying why,
the failover is reported as refused, and the stream ends: never a silent truncation."""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp
import orjson

from baton.model import Backend, FailoverOutcome, FailoverReport, Failure
from dataplane.exceptions import StreamFailed
from dataplane.messages.events import error_event
from dataplane.messages.request import replay_refusal
from dataplane.relay.resume.reports import Reporter
from dataplane.request import ClientRequest
from dataplane.settings import ResumeSettings
from dataplane.sse import ClientStream
from dataplane.upstream.engine import upstream_events

log = logging.getLogger("baton.shim.messages")

# Events after which an engine's Messages stream has nothing more to say.
TERMINAL = frozenset({"message_stop", "error"})


class MessagesRelay:
    def __init__(
        self,
        *,
        settings: ResumeSettings,
        out: ClientStream,
        request_id: str,
        client: ClientRequest,
        reporter: Reporter,
    ) -> None:
        self._settings = settings
        self._out = out
        self._rid = request_id
        self._client = client
        self._reporter = reporter
        self._deltas = 0
        self.first_byte: float | None = None
        self.message: dict[str, Any] | None = None  # message_start's, for the span
        self.stop_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    async def run(self, backend: Backend, upstream: aiohttp.ClientResponse, first: bytes) -> bool:
        """True when the engine's last event reached the client (message_stop, or the
        engine's own error), False when the shim ended the stream with an error event."""
        try:
            async for events in upstream_events(upstream, first, self._settings):
                out: list[bytes] = []
                for ev in events:
                    kind = self._see(ev.data)
                    out.append(ev.raw)
                    if kind in TERMINAL:
                        await self._write(b"".join(out))
                        return kind == "message_stop"
                await self._write(b"".join(out))
        except StreamFailed as failed:
            await self._fail(backend, failed)
            return False
        await self._fail(backend, StreamFailed(Failure.TRUNCATED, "stream ended early"))
        return False

    def _see(self, data: bytes) -> str:
        """The event's type, noting what the span reports of it."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise StreamFailed(Failure.GARBAGE, "an event that is not JSON") from None
        if not isinstance(obj, dict):
            raise StreamFailed(Failure.GARBAGE, "an event that is not an object")
        kind = str(obj.get("type", ""))
        if kind == "content_block_delta":
            self._deltas += 1
        elif kind == "message_start" and isinstance(obj.get("message"), dict):
            self.message = obj["message"]
        elif kind == "message_delta":
            delta, usage = obj.get("delta"), obj.get("usage")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self.stop_reason = delta["stop_reason"]
            if isinstance(usage, dict):
                self.usage = usage
        return kind

    async def _write(self, data: bytes) -> None:
        if data:
            if self.first_byte is None:
                self.first_byte = time.monotonic()
            await self._out.write(data)

    async def _fail(self, backend: Backend, failed: StreamFailed) -> None:
        why = replay_refusal(self._client.body) or "it is relayed as the engine sends it"
        message = (f"backend {backend.id} failed mid-stream ({failed.failure}) and the "
                   f"message cannot be resumed: {why}")  # fmt: skip
        log.info("request %s: %s", self._rid, message)
        self._reporter.send(
            FailoverReport(
                request_id=self._rid, from_backend=backend.id, to_backend="",
                failure=failed.failure, choice=0, tokens_sent=self._deltas, path=None,
                seam=None, gap_ms=0.0, attempt=1, outcome=FailoverOutcome.REFUSED,
                detail=message,
            )  # fmt: skip
        )
        await self._write(error_event("api_error", message))
