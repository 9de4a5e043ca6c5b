"""aiohttp wiring of the Anthropic Messages API: /v1/messages and /v1/messages/count_tokens.

As vLLM 0.32 serves them (entrypoints/anthropic/api_router.py): the body is checked
as a pydantic model first (sim.messages_request; a bad body is a 400 in the OpenAI
shape), then converted into a chat request (sim.messages_api) that the sim's chat
path generates exactly as /v1/chat/completions would, and the chat response or
stream is converted back (sim.messages_events). Errors from there on are in the
Anthropic shape, ``{"type": "error", "error": {"type", "message"}}``, with the
OpenAI error type ("BadRequestError", "NotFoundError", ...) and the status code.

Faults (sim.faults) are the chat stream's, converted as vLLM converts them: a cut
connection (die, reset, exit) or a stall happens where it would for chat,
``error-after`` becomes vLLM's ``event: error`` that ends the stream, and
``abort-after`` ends the message with stop_reason null; ``status`` and ``garbage``
answer before the request is read. count_tokens generates nothing and has no faults.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

from sim import messages_events as me
from sim import responses as r
from sim.chat_template import TemplateError, parse_messages, render
from sim.http_common import error_type, garbage, ok, request_faults, serve_run
from sim.messages_api import chat_body
from sim.messages_request import check_count, check_messages
from sim.protocol import ApiError, bad_request, check_model, parse_chat
from sim.run import Run
from sim.schema import WRONG_MEDIA_TYPE, Checker, invalid, not_json
from sim.state import STATE

REQUEST_ID_HEADER = "X-Request-Id"


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


def anthropic_error(e: ApiError) -> web.Response:
    return web.Response(
        status=e.status, body=orjson.dumps(me.error_body(e.type, e.message)),
        content_type="application/json",
    )  # fmt: skip


def _signature() -> str:
    return uuid.uuid4().hex


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object FastAPI hands the model (its errors are validation 400s too)."""
    if request.content_type != "application/json":
        raise invalid([WRONG_MEDIA_TYPE])
    raw = await request.read()
    if not raw:
        c = Checker()
        c.fail("missing", (), "Field required", None)
        raise invalid(c.errors)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise not_json(raw) from None
    if not isinstance(body, dict):
        c = Checker()
        c.model(body, ())
        raise invalid(c.errors)
    return body


async def create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    faults = request_faults(request, state)
    if faults.status is not None:
        return anthropic_error(ApiError(faults.status, "injected fault", error_type(faults.status)))
    if faults.garbage:
        return await garbage(request)
    req = check_messages(await _body(request))
    chat = chat_body(req)
    adapter = state.loras.resolve(chat.get("model"))  # vLLM serves it as a chat request
    limits = state.loras.limits(adapter)
    try:
        gen = parse_chat(chat, state.tokenizer, limits)
    except ApiError as e:
        return anthropic_error(e)
    # vLLM's request id: the X-Request-Id header when there is one.
    rid = request.headers.get(REQUEST_ID_HEADER) or os.urandom(8).hex()  # random_uuid(): 16 hex
    meta = r.Meta(
        id="chatcmpl-" + rid, created=int(time.time()), model=limits.model,
        fingerprint=state.fingerprint, chat=True, return_token_ids=False,
        include_usage=gen.include_usage, continuous_usage=gen.continuous_usage,
        reasoning=state.cfg.reasoning, tools=gen.tool is not None,
        tool_format=state.cfg.model.tool_format, tool_defs=gen.tool.tools if gen.tool else (),
    )  # fmt: skip
    run = MessagesRun(state, state.engine_for(request), gen, faults, meta, adapter)
    return await serve_run(request, run, gen.stream)


async def count_tokens(request: web.Request) -> web.Response:
    """The chat prompt's token count (vLLM renders the chat request and counts its ids)."""
    state = request.app[STATE]
    req = check_count(await _body(request))
    try:
        chat = chat_body(req, count_only=True)
        check_model(chat, state.loras.limits(state.loras.resolve(chat.get("model"))))
        try:
            text = render(parse_messages(chat["messages"]),
                          open_think=state.tokenizer.think_start is not None)  # fmt: skip
        except TemplateError as e:
            raise bad_request(str(e), "messages") from None
    except ApiError as e:
        return anthropic_error(e)
    n = len(state.tokenizer.encode(text))
    return ok({"input_tokens": n, "context_management": {"original_input_tokens": n}})


class MessagesRun(Run):
    """A chat generation whose response is converted into the Messages API's."""

    def _error(self, status: int, message: str, type_: str = "InternalServerError") -> web.Response:
        return anthropic_error(ApiError(status, message, type_))

    def _full_body(self) -> dict[str, object]:
        return me.message(super()._full_body(), _signature)

    def _stream_response(self) -> web.StreamResponse:
        return _Converted(
            me.StreamConverter(_signature),
            # Starlette's StreamingResponse adds the charset; no Cache-Control.
            headers={"Content-Type": "text/event-stream; charset=utf-8"},
        )


class _Converted(web.StreamResponse):
    """A response that is sent the chat stream's bytes and writes the Messages events."""

    def __init__(self, converter: me.StreamConverter, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._converter = converter

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        out = self._converter.feed(bytes(data))
        if out:
            await super().write(out)
