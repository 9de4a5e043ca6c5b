"""A Responses or Messages stream relayed as the engine sends it: a request that cannot be
replayed on another engine (the API's replay_refusal: stored, a follow-up, tools, images, a
thinking budget...). Its events go to the client untouched; a stored response's id reaches
control (ownership) before it reaches the client. When the engine fails before its last
event, the stream cannot go on elsewhere, so the client gets its API's own end (the
EngineStream's failure: response.failed, an Anthropic `error` event), the failover is
reported as refused, and the stream ends: never a silent truncation."""

from __future__ import annotations

import logging
import time

import aiohttp
import orjson

from baton.model import Backend, FailoverOutcome, FailoverReport, Failure
from dataplane.apis.api import EngineStream
from dataplane.exceptions import ControlUnavailable, StreamFailed
from dataplane.link.needs import Ownership
from dataplane.relay.resume.reports import Reporter
from dataplane.request import ClientRequest
from dataplane.settings import ResumeSettings
from dataplane.sse import ClientStream
from dataplane.upstream.engine import upstream_events

log = logging.getLogger("baton.shim.passthrough")


class PassthroughRelay:
    def __init__(
        self,
        stream: EngineStream,
        *,
        control: Ownership,
        settings: ResumeSettings,
        out: ClientStream,
        request_id: str,
        client: ClientRequest,
        reporter: Reporter,
    ) -> None:
        self._stream = stream
        self._control = control
        self._settings = settings
        self._out = out
        self._rid = request_id
        self._client = client
        self._reporter = reporter
        self.first_byte: float | None = None

    async def run(self, backend: Backend, upstream: aiohttp.ClientResponse, first: bytes) -> bool:
        """True when the engine's last event reached the client (complete, or the engine's
        own failure), False when the shim ended the stream with its API's error events."""
        try:
            async for events in upstream_events(upstream, first, self._settings):
                out: list[bytes] = []
                for event in events:
                    obj = _event(event.data)
                    kind = self._stream.see(obj)
                    key = self._stream.announces(obj)
                    if key is not None:
                        await self._write(b"".join(out))
                        out.clear()
                        await self._own(backend, key)
                    out.append(event.raw)
                    ended = self._stream.end(kind)
                    if ended is not None:
                        await self._write(b"".join(out))
                        return ended
                await self._write(b"".join(out))
        except StreamFailed as failed:
            await self._fail(backend, failed)
            return False
        await self._fail(backend, StreamFailed(Failure.TRUNCATED, "stream ended early"))
        return False

    async def _own(self, backend: Backend, key: str) -> None:
        try:
            await self._control.record_owner(self._rid, key, backend.id, self._client.model)
        except ControlUnavailable as exc:
            log.warning("request %s: %s stored on %s, but control does not know (%s): a "
                        "follow-up will be refused", self._rid, key, backend.id, exc)  # fmt: skip

    async def _write(self, data: bytes) -> None:
        if data:
            if self.first_byte is None:
                self.first_byte = time.monotonic()
            await self._out.write(data)

    async def _fail(self, backend: Backend, failed: StreamFailed) -> None:
        message = (f"backend {backend.id} failed mid-stream ({failed.failure}) and the "
                   f"{self._stream.noun} cannot be resumed: {self._stream.why}")  # fmt: skip
        log.info("request %s: %s", self._rid, message)
        self._reporter.send(
            FailoverReport(
                request_id=self._rid, from_backend=backend.id, to_backend="",
                failure=failed.failure, choice=0, tokens_sent=self._stream.deltas, path=None,
                seam=None, gap_ms=0.0, attempt=1, outcome=FailoverOutcome.REFUSED,
                detail=message,
            )  # fmt: skip
        )
        await self._write(self._stream.failure(message))


def _event(data: bytes) -> dict[str, object]:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise StreamFailed(Failure.GARBAGE, "an event that is not JSON") from None
    if not isinstance(obj, dict):
        raise StreamFailed(Failure.GARBAGE, "an event that is not an object")
    return obj
