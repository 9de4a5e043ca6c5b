"""The simulated engine's aiohttp app: its routes, middlewares and the core endpoints.

Only translation lives here: JSON <-> domain values (sim.protocol), the
per-request lifecycle (sim.run), and one error shape for every failure. The state is
sim.state's and the shared HTTP pieces sim.http_common's, so the other route modules
(sim.*_http) build on those and this module only assembles them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from sim import generate_http, kv_http, lora_http, messages_http, pooling_http, responses_http
from sim import responses as r
from sim.batch_http import batch_of, complete_batch
from sim.chat_template import TemplateError, parse_messages, render
from sim.config import SimConfig
from sim.http_common import (
    error_response,
    error_type,
    garbage,
    json_body,
    ok,
    request_faults,
    serve_run,
)
from sim.logprob_request import parse_chat_with_logprobs, parse_completion_with_logprobs
from sim.metrics import CONTENT_TYPE
from sim.protocol import (
    ApiError,
    GenRequest,
    Limits,
    bad_request,
    check_model,
    prompt_to_ids,
)
from sim.run import Run
from sim.state import STATE, SimState
from sim.tokenizer import Tokenizer

MAX_BODY_BYTES = 64 * 1024 * 1024
Parser = Callable[[Mapping[str, Any], Tokenizer, Limits], GenRequest]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(cfg: SimConfig) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors, _api_key])
    app[STATE] = SimState(cfg)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    responses_http.add_routes(app)
    messages_http.add_routes(app)
    pooling_http.add_routes(app)
    kv_http.add_routes(app)
    generate_http.add_routes(app)
    lora_http.add_routes(app)
    return app


async def start_server(
    cfg: SimConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Bind and serve in the running loop; returns the runner (cleanup() stops it) and port.

    handler_cancellation: a client disconnect cancels the handler, so generation
    stops at once (the router's "disconnect cancels upstream" relies on it).
    """
    runner = web.AppRunner(create_app(cfg), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    addresses = runner.addresses
    return runner, (addresses[0][1] if addresses else port)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One error shape for everything, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(ApiError(e.status, e.reason, error_type(e.status)))


@web.middleware
async def _api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    """vLLM's AuthenticationMiddleware: on /v1/* and /inference/* only (health, metrics,
    tokenize stay open),
    ``Authorization: Bearer <key>`` (the scheme in any case; an Anthropic client's
    ``x-api-key`` is not read), else 401 ``{"error": "Unauthorized"}``."""
    key = request.app[STATE].cfg.api_key
    if key and request.path.startswith(("/v1/", "/inference/")):
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or given != key:
            return web.Response(status=401, body=b'{"error":"Unauthorized"}',
                                content_type="application/json")  # fmt: skip
    return await handler(request)


# -- generation ----------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat_with_logprobs)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await json_body(request)
    prompts = batch_of(body.get("prompt"))
    if prompts is None:
        return await _generate(request, parse_completion_with_logprobs, body)
    return await complete_batch(
        body, prompts, lambda one: _generate(request, parse_completion_with_logprobs, one)
    )


async def _generate(
    request: web.Request, parse: Parser, body: dict[str, Any] | None = None
) -> web.StreamResponse:
    """`body`: the request's, already read (a batch's: one prompt of it)."""
    state = request.app[STATE]
    faults = request_faults(request, state)
    if faults.status is not None:
        raise ApiError(faults.status, "injected fault", error_type(faults.status))
    if faults.garbage:
        return await garbage(request)
    body = body if body is not None else await json_body(request)
    adapter = state.loras.resolve(body.get("model"))  # a LoRA adapter's name runs under it
    limits = state.loras.limits(adapter)
    req = parse(body, state.tokenizer, limits)
    chat = req.kind == "chat"
    meta = r.Meta(
        id=("chatcmpl-" if chat else "cmpl-") + os.urandom(16).hex(),
        created=int(time.time()),
        model=limits.model,
        fingerprint=state.fingerprint,
        chat=chat,
        return_token_ids=req.return_token_ids,
        include_usage=req.include_usage,
        continuous_usage=req.continuous_usage,
        role=req.role,
        reasoning=chat and state.cfg.reasoning,
        include_reasoning=req.include_reasoning,
        tools=chat and req.tool is not None,
        tool_format=state.cfg.model.tool_format,
        tool_defs=req.tool.tools if chat and req.tool else (),
    )
    engine = state.engine_for(request)
    run = Run(state, engine, req, faults, meta, adapter)
    return await serve_run(request, run, req.stream)


# -- tokenizer endpoints ---------------------------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await json_body(request)
    check_model(body, state.loras.limits(state.loras.resolve(body.get("model"))))
    add_special = body.get("add_special_tokens")
    if "messages" in body:
        try:
            text = render(
                parse_messages(body["messages"]),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                open_think=state.tokenizer.think_start is not None,
            )
        except TemplateError as e:
            raise bad_request(str(e), "messages") from None
        ids = state.tokenizer.encode(text)  # the template already starts with <|bos|>
    elif isinstance(body.get("prompt"), str):
        ids = prompt_to_ids(body["prompt"], state.tokenizer, add_special is not False)
    else:
        raise bad_request("'prompt' (a string) or 'messages' is required")
    out: dict[str, Any] = {
        "count": len(ids), "max_model_len": state.cfg.limits.max_model_len, "tokens": ids
    }
    if body.get("return_token_strs") is True:  # vLLM's: each token as its vocabulary entry
        out["token_strs"] = [state.tokenizer.texts[i] for i in ids]
    return ok(out)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await json_body(request)
    check_model(body, state.loras.limits(state.loras.resolve(body.get("model"))))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not state.tokenizer.valid_ids(tokens):
        raise bad_request(
            f"'tokens' must be a list of token ids in [0, {state.tokenizer.vocab_size})", "tokens"
        )
    return ok({"prompt": state.tokenizer.decode(tokens)})


# -- info endpoints ----------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = state.cfg.limits.model
    card = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "sim",
        "root": name,
        "parent": None,
        "max_model_len": state.cfg.limits.max_model_len,
        "permission": [],
    }
    return ok({"object": "list", "data": [card, *lora_http.cards(state)]})


async def version(request: web.Request) -> web.Response:
    return ok({"version": "sim"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
