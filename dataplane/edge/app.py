"""Wiring of the shim: one ClientSession and one control channel per process, owned by
cleanup contexts so they open before the first request and close after the last."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from baton.model import Backend
from baton.tracing import tracing_from_env
from dataplane.edge.handlers import (
    CONTROL,
    HEALTH,
    LIMITS,
    MAX_BODY,
    METRICS,
    PROXY,
    SLOTS,
    STORED,
    TRACING,
    add_routes,
    openai_errors,
    request_limits,
)
from dataplane.edge.health import Health
from dataplane.edge.lifecycle import graceful, install
from dataplane.edge.limits import StreamSlots
from dataplane.edge.proxy import Proxy
from dataplane.edge.quota import add_quota_headers
from dataplane.link.control_link import ControlLink
from dataplane.metrics import ShimMetrics
from dataplane.responses.stored import StoredResponses
from dataplane.settings import ShimSettings
from dataplane.upstream import buffers
from dataplane.upstream.standby import Standby


def make_app(settings: ShimSettings) -> web.Application:
    # client_max_size one byte over the limit: aiohttp raises, the handler answers in
    # OpenAI's shape.
    # `graceful` is outermost: at a shutdown deadline it ends whatever the others started.
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[graceful, openai_errors, request_limits],
    )
    install(app)
    app.on_response_prepare.append(add_quota_headers)
    app[MAX_BODY] = settings.max_body_bytes
    app[LIMITS] = settings.limits
    slots = app[SLOTS] = StreamSlots(settings.limits)

    links: list[ControlLink] = []  # the control link, once the app has started

    def routable() -> bool:  # a request could be routed now: control sent a snapshot
        return bool(links) and links[0].has_snapshot

    cap = settings.limits.max_streams
    app[HEALTH] = Health(lambda: slots.in_use, cap, routable, time.monotonic)

    async def resources(app: web.Application) -> AsyncIterator[None]:
        control = ControlLink(
            settings.control,
            route_timeout=settings.route_timeout,
            token=settings.control_token,
            tls_ca=settings.control_tls_ca,
        )
        # Resumes get a pool of their own, kept warm by Standby.
        async with _session(settings) as session, _session(settings) as resumes:
            await control.start()
            app[CONTROL] = control
            links.append(control)
            metrics = ShimMetrics(control.link_stats)
            app[METRICS] = metrics
            tracing = tracing_from_env("baton-shim")
            app[TRACING] = tracing
            app[PROXY] = Proxy(session, control, settings.proxy, metrics, tracing, resumes)
            app[STORED] = StoredResponses(session, control, settings.proxy.timeouts)
            spare = settings.proxy.resume.standby_connections
            standby = Standby(
                resumes, lambda: resume_targets(control), spare, settings.keepalive_timeout / 3
            )
            warming = asyncio.create_task(standby.run()) if spare > 0 else None
            yield
            if warming is not None:
                warming.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await warming
            await control.close()
            tracing.shutdown()  # flush the last spans

    app.cleanup_ctx.append(resources)
    add_routes(app)
    return app


def _session(settings: ShimSettings) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections, keepalive_timeout=settings.keepalive_timeout
    )
    bufsize = buffers.read_bufsize(settings.proxy.resume.stream_buffer)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, read_bufsize=bufsize)


def resume_targets(control: ControlLink) -> list[Backend]:
    """Where a stream may resume, by the last snapshot: routable backends that serve
    clients and are not being drained."""
    return [
        s.backend
        for s in control.fleet.snapshot.backends
        if s.routable and s.backend.serves_clients and not s.migrating
    ]
