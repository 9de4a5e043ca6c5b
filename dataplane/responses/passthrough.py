"""A Responses stream relayed as the engine sends it: a request that cannot be replayed on
another engine (request.replay_refusal: stored, a follow-up, tools, reasoning...). Its
events go to the client untouched; a stored response's id reaches control (ownership) before
it reaches the client. When the engine fails before the last event, the stream cannot go on
elsewhere, so the client gets the Responses API's own end, `response.failed` with why, the
failover is reported as refused, and the stream ends: never a silent truncation."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import aiohttp
import orjson

from baton.model import Backend, FailoverOutcome, FailoverReport, Failure
from dataplane.exceptions import ControlUnavailable, StreamFailed
from dataplane.link.needs import FailoverAudit, Ownership
from dataplane.relay.resume.reports import Reporter
from dataplane.request import ClientRequest
from dataplane.responses.request import replay_refusal, stored
from dataplane.settings import ResumeSettings
from dataplane.sse import ClientStream
from dataplane.upstream.engine import upstream_events

log = logging.getLogger("baton.shim.responses")

# Events after which an engine's Responses stream has nothing more to say.
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})


class PassthroughControl(Ownership, FailoverAudit, Protocol):
    """What a relayed Responses stream asks of control."""


class ResponsesRelay:
    def __init__(
        self,
        *,
        control: PassthroughControl,
        settings: ResumeSettings,
        out: ClientStream,
        request_id: str,
        client: ClientRequest,
        reporter: Reporter,
    ) -> None:
        self._control = control
        self._settings = settings
        self._out = out
        self._rid = request_id
        self._client = client
        self._reporter = reporter
        self._created: dict[str, Any] | None = None  # the response object it announced
        self._seq = -1  # the last sequence_number relayed
        self._deltas = 0
        self.first_byte: float | None = None
        self.response: dict[str, Any] | None = None  # the last response object it carried

    async def run(self, backend: Backend, upstream: aiohttp.ClientResponse, first: bytes) -> bool:
        """True when the engine's last event reached the client (completed, or the engine's
        own failure), False when the shim ended the stream with response.failed."""
        try:
            async for events in upstream_events(upstream, first, self._settings):
                out: list[bytes] = []
                for event in events:
                    kind = await self._see(backend, event.data, out)
                    out.append(event.raw)
                    if kind in TERMINAL:
                        await self._write(b"".join(out))
                        return kind != "response.failed" and kind != "error"
                await self._write(b"".join(out))
        except StreamFailed as failed:
            await self._fail(backend, failed)
            return False
        await self._fail(backend, StreamFailed(Failure.TRUNCATED, "stream ended early"))
        return False

    async def _see(self, backend: Backend, data: bytes, out: list[bytes]) -> str:
        """The event's type, noting what the shim needs of it; a stored response's id goes
        to control before the event that carries it goes to the client."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise StreamFailed(Failure.GARBAGE, "an event that is not JSON") from None
        if not isinstance(obj, dict):
            raise StreamFailed(Failure.GARBAGE, "an event that is not an object")
        kind = str(obj.get("type", ""))
        if isinstance(obj.get("sequence_number"), int):
            self._seq = obj["sequence_number"]
        if kind == "response.output_text.delta":
            self._deltas += 1
        response = obj.get("response")
        if kind == "response.created" and isinstance(response, dict):
            self._created = response
            if stored(self._client.body) and isinstance(response.get("id"), str):
                await self._write(b"".join(out))
                out.clear()
                await self._own(backend, response["id"])
        if isinstance(response, dict):
            self.response = response
        return kind

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
        why = replay_refusal(self._client.body) or "it is relayed as the engine sends it"
        message = (f"backend {backend.id} failed mid-stream ({failed.failure}) and the "
                   f"response cannot be resumed: {why}")  # fmt: skip
        log.info("request %s: %s", self._rid, message)
        self._reporter.send(
            FailoverReport(
                request_id=self._rid, from_backend=backend.id, to_backend="",
                failure=failed.failure, choice=0, tokens_sent=self._deltas, path=None,
                seam=None, gap_ms=0.0, attempt=1, outcome=FailoverOutcome.REFUSED,
                detail=message,
            )  # fmt: skip
        )
        await self._write(failed_event(self._created, self._seq + 1, message))


def failed_event(created: dict[str, Any] | None, seq: int, message: str) -> bytes:
    """response.failed for the response the engine announced (an `error` event when it
    announced none)."""
    error = {"code": "server_error", "message": message}
    if created is None:
        data: dict[str, Any] = {"type": "error", **error, "param": None, "sequence_number": seq}
    else:
        response = {**created, "status": "failed", "error": error}
        data = {"type": "response.failed", "sequence_number": seq, "response": response}
    kind: str = data["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
