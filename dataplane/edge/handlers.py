"""The shim's HTTP endpoints (OpenAI API surface). Parsing and policy live elsewhere;
these functions only connect request → validate → route → proxy → response."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baton.model import RequestOutcome
from baton.tracing import SpanKind, Tracing
from dataplane.apis.table import APIS, parse_request
from dataplane.edge.health import PATHS as HEALTH_PATHS
from dataplane.edge.health import Health
from dataplane.edge.limits import StreamSlots, check_head, check_request
from dataplane.edge.proxy import Exchange, Proxy
from dataplane.edge.quota import QUOTA, TENANT
from dataplane.edge.shape import SESSION_HEADER, adapter_of, session_of, shape_of, with_request
from dataplane.exceptions import ControlUnavailable, ErrorKind, ErrorShape, OpenAIError
from dataplane.link.needs import Routing
from dataplane.metrics import ShimMetrics
from dataplane.outcomes import UNSERVED, outcome
from dataplane.refusals import refusal
from dataplane.request import ClientRequest, Endpoint
from dataplane.responses.stored import StoredResponses
from dataplane.settings import Limits

CONTROL = web.AppKey("control", Routing)
PROXY = web.AppKey("proxy", Proxy)
MAX_BODY = web.AppKey("max_body", int)
METRICS = web.AppKey("metrics", ShimMetrics)
TRACING = web.AppKey("tracing", Tracing)
LIMITS = web.AppKey("limits", Limits)
SLOTS = web.AppKey("stream_slots", StreamSlots)
STORED = web.AppKey("stored", StoredResponses)
HEALTH = web.AppKey("health", Health)
GENERATING_PATHS = frozenset(e.value for e in Endpoint if e.generates)


def error_response(err: OpenAIError, shape: ErrorShape) -> web.Response:
    """`shape`: whose error shape the client reads (its API's; a path's where none was
    chosen: ErrorShape.of_path)."""
    status, body = err.shaped(shape)
    return web.Response(
        body=body, status=status, content_type="application/json", headers=err.headers
    )


async def _completion(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    metrics = request.app[METRICS]
    metrics.in_flight.inc()
    status = 499  # until answered: a client that goes away lands here
    try:
        with request.app[TRACING].span(f"POST {endpoint.value}", SpanKind.SERVER) as span:
            resp = await _answer(request, endpoint)
            status = resp.status
            if span is not None:
                span.set_attribute("http.response.status_code", status)
        return resp
    finally:
        metrics.in_flight.dec()
        metrics.count(metrics.requests, endpoint.value, str(status))


async def _answer(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    app = request.app
    try:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise OpenAIError(
                ErrorKind.BODY_TOO_LARGE, f"request body exceeds the limit of {app[MAX_BODY]} bytes"
            ) from None
        client = parse_request(raw, endpoint, app[MAX_BODY])
        check_request(app[LIMITS], client)
        return await _route_and_serve(request, client, raw)
    except OpenAIError as err:
        return error_response(err, APIS[endpoint].errors)


async def _route_and_serve(
    request: web.Request, client: ClientRequest, raw: bytes
) -> web.StreamResponse:
    app = request.app
    try:
        ex = _exchange(
            client,
            raw,
            session_of(client, request.headers.get(SESSION_HEADER)),
            request.headers,
            request.get(TENANT, ""),
            adapter_of(app[CONTROL].fleet.snapshot, client.model),
        )
        started = time.perf_counter()
        tracing = app[TRACING]
        try:
            with tracing.span(
                "baton.route", SpanKind.CLIENT, request_id=ex.request_id, model=client.model
            ) as span:
                traceparent = tracing.traceparent() if span is not None else ""
                decision = await app[CONTROL].route(ex.request_id, ex.shape, traceparent)
                if span is not None:
                    span.set_attribute("baton.reason", decision.reason.value)
                    if ex.shape.tenant:  # its id, never its key
                        span.set_attribute("baton.tenant", ex.shape.tenant)
        except ControlUnavailable as exc:
            raise OpenAIError(ErrorKind.CONTROL_UNAVAILABLE, str(exc)) from None
        app[METRICS].route.observe(time.perf_counter() - started)
        if decision.quota is not None:
            request[QUOTA] = decision.quota  # told in x-ratelimit-* headers (quota_headers)
        if not decision.backends:
            raise refusal(decision, client.model)
        try:
            return await app[PROXY].serve(request, ex, decision)
        except OpenAIError:
            # No backend served it (each attempt's failure was reported): control must not
            # count it as in flight for its tenant any longer.
            app[CONTROL].finished(_unserved(ex))
            raise
    except OpenAIError as err:
        return error_response(err, APIS[client.endpoint].errors)


def _unserved(ex: Exchange) -> RequestOutcome:
    return outcome(ex.request_id, "", ex.client.model, UNSERVED)


def _exchange(
    client: ClientRequest,
    raw: bytes,
    session: str,
    headers: Mapping[str, str],
    tenant: str,
    adapter: str | None,
) -> Exchange:
    """`adapter`: the LoRA adapter the client's model names (None: a base model), whose
    prefix hashes, session and blocks are its own (dataplane/edge/shape.py)."""
    rid = os.urandom(16).hex()  # 128 random bits, as uuid4's hex, without building a UUID
    api = APIS[client.endpoint]
    served = api.as_chat(client)
    if served is None:
        sent = {k: v for k in api.forwarded if (v := headers.get(k))}
        shape = with_request(shape_of(client, adapter=adapter), session, tenant, adapter)
        return Exchange(rid, client, api, raw, shape, headers=sent, adapter=adapter)
    chat = served.client
    shape = with_request(shape_of(chat, adapter=adapter), session, tenant, adapter)
    return Exchange(rid, chat, APIS[chat.endpoint], served.raw, shape, events=served.events,
                    adapter=adapter)  # fmt: skip


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, Endpoint.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, Endpoint.COMPLETIONS)


async def models(request: web.Request) -> web.Response:
    fleet = request.app[CONTROL].fleet
    created = int(time.time())
    data: list[dict[str, object]] = []
    for m in fleet.models:
        entry: dict[str, object] = {"id": m, "object": "model", "created": created,
                                    "owned_by": "baton"}  # fmt: skip
        if m in fleet.model_lens:  # vLLM's field: the least any of the model's backends has
            entry["max_model_len"] = fleet.model_lens[m]
        data.append(entry)
    return web.json_response({"object": "list", "data": data})


async def stored_response(request: web.Request) -> web.Response:
    """Retrieve, delete or cancel a stored response, on the backend that holds it."""
    metrics = request.app[METRICS]
    resp = await request.app[STORED].serve(request)
    metrics.count(metrics.requests, Endpoint.RESPONSES.value + "/{id}", str(resp.status))
    return resp


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def health(request: web.Request) -> web.Response:
    """The probes on a connection the front door handed over (a keep-alive one that asked
    something else first): the same answers as the front door's (dataplane/edge/health.py)."""
    answer = request.app[HEALTH].answer(request.path)
    return web.Response(body=answer.body, status=answer.status, content_type="text/plain")


@web.middleware
async def openai_errors(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """aiohttp's own 404/405 are plain text; OpenAI clients expect the JSON error shape."""
    shape = ErrorShape.of_path(request.path)
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(
            OpenAIError(ErrorKind.NOT_FOUND, f"no route for {request.path}"), shape
        )
    except web.HTTPMethodNotAllowed:
        return error_response(
            OpenAIError(
                ErrorKind.METHOD_NOT_ALLOWED, f"{request.method} is not allowed on {request.path}"
            ),
            shape,
        )


@web.middleware
async def request_limits(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """Header size, API key, declared body size and the in-flight cap, before the body is
    read: a request refused for load costs no parsing and no routing."""
    app = request.app
    generating = request.method == "POST" and request.path in GENERATING_PATHS
    try:
        if app[HEALTH].draining and request.path not in HEALTH_PATHS:
            raise OpenAIError(
                ErrorKind.SHUTTING_DOWN, "the shim is shutting down; retry on another"
            )
        request[TENANT] = check_head(
            app[LIMITS],
            request.method,
            request.raw_path,
            request.raw_headers,
            request.headers.get("Authorization"),
            request.content_length,
            app[MAX_BODY],
            request.headers.get("x-api-key"),
            app[CONTROL].fleet.tenant_keys,
        )
        if generating:
            app[SLOTS].acquire()
    except OpenAIError as err:
        return error_response(err, ErrorShape.of_path(request.path))
    if not generating:
        return await handler(request)
    try:
        return await handler(request)
    finally:
        app[SLOTS].release()


def _post(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _completion(request, endpoint)

    return handler


def add_routes(app: web.Application) -> None:
    app.router.add_post(Endpoint.CHAT.value, chat_completions)
    app.router.add_post(Endpoint.COMPLETIONS.value, completions)
    app.router.add_post(Endpoint.RESPONSES.value, _post(Endpoint.RESPONSES))
    app.router.add_post(Endpoint.MESSAGES.value, _post(Endpoint.MESSAGES))
    item = Endpoint.RESPONSES.value + "/{response_id}"
    app.router.add_get(item, stored_response)
    app.router.add_delete(item, stored_response)
    app.router.add_post(item + "/cancel", stored_response)
    for endpoint in Endpoint:
        if not endpoint.generates:
            app.router.add_post(endpoint.value, _post(endpoint))
    app.router.add_get("/v1/models", models)
    for path in HEALTH_PATHS:
        app.router.add_get(path, health)
    app.router.add_get("/metrics", metrics)
