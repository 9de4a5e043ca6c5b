"""Send a validated request to the decision's backends in order until one answers, then
relay its answer to the client: whole for plain requests, event by event for streams."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from aiohttp import web
from opentelemetry.util.types import AttributeValue

from baton.model import Backend, Decision, Failure, PrefixBlocks, RequestShape
from baton.tracing import Tracing
from dataplane.apis.answers import check_answer, usage_counts
from dataplane.apis.api import Api, EngineStream
from dataplane.apis.passthrough import PassthroughRelay
from dataplane.edge.clientwrite import GuardedStream
from dataplane.exceptions import AttemptFailed, ControlUnavailable, ErrorKind, OpenAIError
from dataplane.link.needs import Outcomes, Ownership
from dataplane.metrics import ShimMetrics
from dataplane.outcomes import CLIENT_GONE, cached_count, outcome
from dataplane.relay.background import Background
from dataplane.relay.context import StreamContext
from dataplane.relay.prefixblocks import prefix_blocks
from dataplane.relay.resume.markers import MarkerCache
from dataplane.relay.resume.reports import Reporter
from dataplane.relay.stream import RelayControl, Relayed, StreamRelay, with_token_ids
from dataplane.request import ClientRequest
from dataplane.settings import ProxySettings
from dataplane.spec.server import SpecControl, SpecServer
from dataplane.sse import ClientStream
from dataplane.upstream import buffers, genai
from dataplane.upstream.engine import classify_exception, open_attempt, settle
from dataplane.upstream.failures import classify_status

log = logging.getLogger("baton.shim")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class ProxyControl(RelayControl, SpecControl, Outcomes, Ownership, Protocol):
    """What the proxy asks of control (and hands to the relay and the speculative server)."""


@dataclass(slots=True)
class Exchange:
    """One client request on its way through the proxy (lifecycle only, no wire objects)."""

    request_id: str
    client: ClientRequest  # what goes to the engine (the chat request, when served as chat)
    api: Api  # the API of `client` (dataplane/apis/table.py)
    raw: bytes
    shape: RequestShape
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    # A Responses or Messages request served as chat (Api.as_chat): the client's stream in
    # its own API's events around the relay's chat stream.
    events: Callable[[ClientStream], ClientStream] | None = None
    # Headers of the client's that go to the engine with the request (the Messages API's
    # anthropic-version and -beta); nothing else of the client's request goes upstream.
    headers: Mapping[str, str] = field(default_factory=dict)
    # The LoRA adapter the request names (dataplane/edge/shape.py: adapter_of), None for a base
    # model: decided once, with its shape, so the blocks it reports are keyed the same way.
    adapter: str | None = None


class Proxy:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        control: ProxyControl,
        settings: ProxySettings,
        metrics: ShimMetrics,
        tracing: Tracing,
        resumes: aiohttp.ClientSession,
    ) -> None:
        """`resumes`: the session failovers resume on, a pool of its own that
        dataplane/upstream/standby.py keeps warm."""
        self._resumes = resumes
        self._metrics = metrics
        self._tracing = tracing
        self._session = session
        self._control = control
        self._settings = settings
        self._background = Background()
        self._spec = SpecServer(session, control, settings.timeouts, settings.budget,
                                metrics, settings.spec)  # fmt: skip
        self._markers = MarkerCache(resumes)

    async def serve(
        self, request: web.Request, ex: Exchange, decision: Decision
    ) -> web.StreamResponse:
        if decision.pairing is not None:
            try:
                return await self._spec.serve(request, ex.request_id, ex.client, ex.shape,
                                              decision)  # fmt: skip
            except AttemptFailed as failed:
                # Nothing reached the client: serve it the ordinary way.
                log.info("request %s: speculative start failed (%s)", ex.request_id, failed)
        last: AttemptFailed | None = None
        for attempt, backend in enumerate(decision.backends):
            if not self._settings.budget.allows(attempt, time.monotonic() - ex.started):
                break
            client = ex.client
            with self._tracing.client_span(
                functools.partial(genai.span_name, client.endpoint, client.model),
                functools.partial(_attempt_attributes, client, backend, attempt),
            ) as span:
                try:
                    return await self._attempt(request, ex, decision, attempt, backend)
                except AttemptFailed as failed:
                    last = failed
                    self._report_failure(ex, backend, failed)
                    if span is not None:
                        span.set_attribute("baton.failure", str(failed.failure))
                        span.set_attribute("error.type", str(failed.failure))
        detail = f" (last: {last})" if last else ""
        raise OpenAIError(ErrorKind.BACKEND_FAILED, f"no backend could serve the request{detail}")

    async def _attempt(
        self,
        request: web.Request,
        ex: Exchange,
        decision: Decision,
        attempt: int,
        backend: Backend,
    ) -> web.StreamResponse:
        """One backend: raises AttemptFailed while nothing has reached the client yet."""
        upstream = await self._open(ex, backend)
        settling = False  # handed to _settle: its connection goes back to the pool
        try:
            if ex.client.stream and upstream.status == 200:
                engine = ex.api.engine_stream(ex.client)
                if engine is not None:
                    return await self._relay_engine(request, ex, backend, upstream, engine)
                fallbacks = decision.backends[attempt + 1 :]
                resp, settling = await self._relay_stream(
                    request, ex, backend, upstream, fallbacks
                )
                return resp
            return await self._relay_whole(ex, backend, upstream)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: closing the upstream (below) stops the generation,
            # and control must not count the request as in flight any longer.
            self._control.finished(outcome(ex.request_id, backend.id, ex.client.model,
                                           CLIENT_GONE))  # fmt: skip
            raise
        finally:
            if not settling:
                upstream.close()

    async def _open(self, ex: Exchange, backend: Backend) -> aiohttp.ClientResponse:
        body = with_token_ids(ex.client, backend, ex.raw)
        headers = self._tracing.headers() if self._tracing.enabled else None
        if ex.headers:
            headers = {**(headers or {}), **ex.headers}
        upstream = await open_attempt(
            self._session, backend, ex.client.endpoint.value, body, self._settings.timeouts,
            headers,
        )  # fmt: skip
        failure = classify_status(upstream.status)
        if failure is not None:
            upstream.close()
            raise AttemptFailed(failure, f"status {upstream.status}")
        return upstream

    async def _relay_whole(
        self, ex: Exchange, backend: Backend, upstream: aiohttp.ClientResponse
    ) -> web.Response:
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise classify_exception(exc) from exc
        reply = None
        tokens = (0, 0)
        cached = 0
        if upstream.status == 200:
            # Nothing has reached the client yet: a garbled answer is retried on the next
            # backend like any other failure, never relayed as a 200.
            answer, reply = check_answer(ex.api, body)
            tokens = usage_counts(answer)
            cached = cached_count(answer.get("usage") if isinstance(answer, dict) else None)
            if self._tracing.enabled:
                self._tracing.annotate(genai.answer_attributes(answer))
            key = ex.api.owned(ex.client, answer)
            if key is not None:
                await self._own(ex, backend, key)
        elif self._tracing.enabled:
            self._tracing.annotate({"error.type": str(upstream.status)})
        self._finished(ex, backend, upstream.status, reply, None, *tokens, cached)
        return web.Response(
            body=body,
            status=upstream.status,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                "X-Request-Id": ex.request_id,
            },
        )

    async def _relay_stream(
        self,
        request: web.Request,
        ex: Exchange,
        backend: Backend,
        upstream: aiohttp.ClientResponse,
        fallbacks: tuple[Backend, ...],
    ) -> tuple[web.StreamResponse, bool]:
        """The response, and whether `upstream` was handed to _settle."""
        first, resp = await _start_stream(request, ex, upstream)
        # Handed over, not kept here: the first read can be a burst of events, and this frame
        # lives as long as the stream (the relay parses it once and lets it go).
        box = [first]
        del first
        guard = self._guard(request, resp)
        ctx = StreamContext(
            request_id=ex.request_id,
            client=ex.client,
            shape=ex.shape,
            fallbacks=tuple(fallbacks),
            settings=self._settings.resume,
            timeouts=self._settings.timeouts,
            metrics=self._metrics,
            background=self._background,
            tracing=self._tracing,
            markers=self._markers,
        )
        out: ClientStream = guard if ex.events is None else ex.events(guard)
        relay = StreamRelay(ctx, session=self._resumes, control=self._control, resp=out)
        try:
            try:
                complete = await relay.run(backend, upstream, box.pop())
            finally:
                ex.first_byte = relay.first_byte
            self._stream_finished(ex, relay.relayed(complete, backend), complete)
            await resp.write_eof()
            finished = relay.finished_upstreams()
            self._settle(finished)
        finally:
            relay.close()
            guard.close()
        return resp, any(u is upstream for u in finished)

    def _stream_finished(self, ex: Exchange, end: Relayed, complete: bool) -> None:
        """The span's result and control's outcome of a relayed chat or completions stream."""
        first_choice = end.first_choice
        status = self._control.fleet.snapshot.get(end.served_by.id)
        size = status.kv_block_size if status is not None else 0
        blocks = prefix_blocks(ex.shape, size, first_choice, ex.adapter) if complete else None
        prompt_tokens = len(first_choice.prompt_ids or ()) if first_choice else 0
        if self._tracing.enabled:
            attrs = genai.result_attributes(
                end.response_id, end.model, end.finishes, end.prompt_tokens, end.completion_tokens
            )
            self._tracing.annotate(attrs if complete else {**attrs, "error.type": "stream"})
        self._finished(ex, end.served_by, 200 if complete else 502, end.reply, blocks,
                       prompt_tokens or end.prompt_tokens, end.completion_tokens,
                       end.cached_tokens)  # fmt: skip

    async def _relay_engine(
        self,
        request: web.Request,
        ex: Exchange,
        backend: Backend,
        upstream: aiohttp.ClientResponse,
        engine: EngineStream,
    ) -> web.StreamResponse:
        """An engine's own Responses or Messages stream (one that cannot be replayed
        elsewhere)."""
        first, resp = await _start_stream(request, ex, upstream)
        guard = self._guard(request, resp)
        relay = PassthroughRelay(
            engine,
            control=self._control,
            settings=self._settings.resume,
            out=guard,
            request_id=ex.request_id,
            client=ex.client,
            reporter=Reporter(self._control, self._metrics, self._tracing, self._background,
                              ex.shape.tenant),  # fmt: skip
        )
        try:
            complete = await relay.run(backend, upstream, first)
        finally:
            ex.first_byte = relay.first_byte
            guard.close()
        attrs, inputs, outputs = engine.result()
        if self._tracing.enabled:
            self._tracing.annotate(attrs if complete else {**attrs, "error.type": "stream"})
        self._finished(ex, backend, 200 if complete else 502, None, None, inputs, outputs)
        await resp.write_eof()
        return resp

    def _guard(self, request: web.Request, resp: web.StreamResponse) -> GuardedStream:
        """The client's stream, ended when a write waits --client-write-timeout for it, its
        connection's send buffer capped (--stream-buffer)."""
        timeout = self._settings.client_write_timeout
        buffers.cap_client(request.transport, self._settings.resume.stream_buffer)
        return GuardedStream(request, resp, timeout, self._metrics.client_write_timeouts)

    async def _own(self, ex: Exchange, backend: Backend, key: str) -> None:
        """A stored response's id reaches control before it reaches the client."""
        try:
            await self._control.record_owner(ex.request_id, key, backend.id, ex.client.model)
        except ControlUnavailable as exc:
            log.warning("request %s: %s stored on %s, but control does not know (%s)",
                        ex.request_id, key, backend.id, exc)  # fmt: skip

    def _settle(self, upstreams: list[aiohttp.ClientResponse]) -> None:
        """Give finished upstream connections back to the pool, after the handler: a client
        that hangs up after its [DONE] must not cancel it, nor wait for it."""
        if not upstreams:
            return
        self._background.spawn(_settle_all(upstreams))

    def _finished(
        self,
        ex: Exchange,
        backend: Backend,
        status: int,
        reply: str | None = None,
        blocks: PrefixBlocks | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        now = time.monotonic()
        first = ex.first_byte or now
        self._metrics.count(self._metrics.attempts, backend.id, "ok" if status < 500 else "failed")
        self._metrics.ttft.observe(first - ex.started)
        pinned = reply if ex.api.pins else None
        self._control.finished(
            outcome(
                ex.request_id, backend.id, ex.client.model, status, shape=ex.shape,
                started=ex.started, first_byte=ex.first_byte, now=now, reply=pinned,
                prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, blocks=blocks,
                cached_tokens=cached_tokens,
            )  # fmt: skip
        )

    def _report_failure(self, ex: Exchange, backend: Backend, failed: AttemptFailed) -> None:
        self._metrics.count(self._metrics.attempts, backend.id, failed.failure)
        log.info("request %s: %s failed: %s", ex.request_id, backend.id, failed)
        self._background.spawn(
            self._control.attempt_failed(ex.request_id, backend.id, failed.failure, failed.detail)
        )


def _attempt_attributes(
    client: ClientRequest, backend: Backend, attempt: int
) -> dict[str, AttributeValue]:
    """The attempt's CLIENT span: the GenAI request attributes and which try on which backend."""
    return {**genai.request_attributes(client.endpoint, client.body, client.model, backend),
            "baton.backend": backend.id, "baton.attempt": attempt + 1}  # fmt: skip


async def _start_stream(
    request: web.Request, ex: Exchange, upstream: aiohttp.ClientResponse
) -> tuple[bytes, web.StreamResponse]:
    """The upstream's first piece, and the client's stream response, prepared."""
    first = await _first_piece(upstream)
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, "X-Request-Id": ex.request_id})
    await resp.prepare(request)
    return first, resp


async def _first_piece(upstream: aiohttp.ClientResponse) -> bytes:
    """Read before sending headers: a backend that dies before its first byte is still
    retried invisibly, and the client gets a 200 from whoever answers."""
    try:
        first = await upstream.content.readany()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise classify_exception(exc) from exc
    if not first:
        raise AttemptFailed(Failure.DISCONNECT, "stream closed before its first byte")
    return first


async def _settle_all(upstreams: list[aiohttp.ClientResponse]) -> None:
    await asyncio.gather(*(settle(u) for u in upstreams))
