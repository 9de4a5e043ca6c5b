"""aiohttp wiring of the simulated engine: endpoints, errors, admission.

Only translation lives here: JSON <-> domain values (sim.protocol), the
per-request lifecycle (sim.run), and one error shape for every failure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from sim import responses as r
from sim.balancer import RANK_HEADER, LeastLoaded, header_rank
from sim.chat_template import TemplateError, parse_messages, render
from sim.costmodel import CostParams
from sim.engine import EngineRank
from sim.faults import NO_FAULTS, FaultSpec, FaultSpecError, parse_fault_spec
from sim.kv_wire import KvEventsConfig
from sim.metrics import CONTENT_TYPE, SimMetrics
from sim.model import ModelConfig, ToyModel
from sim.protocol import (
    ApiError,
    GenRequest,
    Limits,
    bad_request,
    check_model,
    parse_chat,
    parse_completion,
    prompt_to_ids,
)
from sim.responses_store import DEFAULT_CAPACITY, ResponseStore
from sim.run import Dropped, Run
from sim.specdecode import SpecConfig
from sim.tokenizer import Tokenizer, build_tokenizer

FAULT_HEADER = "X-Sim-Fault"
MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: ModelConfig
    limits: Limits
    cost: CostParams
    faults: FaultSpec = NO_FAULTS
    max_num_seqs: int = 256
    spec: SpecConfig = SpecConfig()
    tokenizer_variant: int = 0
    tokenizer_drop_merge: int | None = None
    timing_log: str = ""  # append one JSON line per request's first token (benchmarks)
    api_key: str = ""  # like vLLM's --api-key: /v1/* needs "Authorization: Bearer KEY"
    # A byte-level BPE vocabulary whose model emits multi-byte (and invalid) UTF-8.
    byte_level: bool = False
    # <think>/</think> tokens, a template opening "<think>", and chat responses
    # parsed like vLLM's --reasoning-parser deepseek_r1 (see sim.reasoning).
    reasoning: bool = False
    # With reasoning: the think tags are special tokens, so every stream (skip_special_tokens,
    # vLLM's default) drops their text, while the parser still goes by their ids.
    think_special: bool = False
    # <tool_call>/</tool_call> tokens; a chat request offering tools (tool_choice
    # auto) makes a tool call, parsed like vLLM's --enable-auto-tool-choice
    # --tool-call-parser hermes (see sim.tools). Other requests are unchanged.
    tool_calls: bool = False
    # Responses kept for GET / previous_response_id (vLLM with
    # VLLM_ENABLE_RESPONSES_API_STORE=1); 0 = vLLM's default: store ignored.
    responses_store: int = DEFAULT_CAPACITY
    # DELETE /v1/responses/{id} as OpenAI answers it (vLLM 0.32 has no such route: 405).
    responses_delete: bool = False
    embedding_dim: int = 128  # /v1/embeddings vector size (vLLM's tiny Llama gives 128)
    # Publish KV-cache events on ZMQ like vLLM's --kv-events-config (sim.kv_events).
    kv_events: KvEventsConfig | None = None
    # The running sequences share this many context cells, as llama-server's slots do; an
    # overflow fails them all in-band (sim.cells). 0 = no shared limit (vLLM preempts).
    kv_cells: int = 0
    # Engine cores behind the one API server, as vLLM's --data-parallel-size with its
    # internal load balancer: each rank has its own cache, scheduler, metrics children and
    # KV-event publisher (sim.engine); X-data-parallel-rank pins a request (sim.balancer).
    data_parallel_size: int = 1


class SimState:
    """Everything one sim server owns; created inside the running loop. The engine
    state lives in `engines` (one EngineRank per data-parallel rank); the rest is shared."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.tokenizer = build_tokenizer(
            cfg.tokenizer_variant, byte_level=cfg.byte_level, reasoning=cfg.reasoning,
            tool_calls=cfg.tool_calls, think_special=cfg.think_special,
            drop_merge=cfg.tokenizer_drop_merge,
        )
        self.model = ToyModel(cfg.model, self.tokenizer)
        size = max(1, cfg.data_parallel_size)
        self.metrics = SimMetrics(
            cfg.limits.model,
            spec_positions=cfg.spec.num_tokens,
            block_size=cfg.cost.block_size,
            cache_blocks=cfg.cost.cache_blocks,
            engines=size,
        )
        self.engines: list[EngineRank] = []
        try:
            for rank in range(size):
                self.engines.append(EngineRank(rank, cfg, self.metrics.engines[rank]))
        except BaseException:  # a later rank's publisher failed: close the earlier ones
            self.close()
            raise
        self.balancer = LeastLoaded(size)
        self.fingerprint = f"sim-{cfg.model.seed}"
        self.created = int(time.time())
        # Unbuffered appends: a SIGKILLed sim keeps every line it wrote (benchmarks kill them).
        self.responses = ResponseStore(cfg.responses_store)
        self.timing = open(cfg.timing_log, "ab", buffering=0) if cfg.timing_log else None  # noqa: SIM115

    def engine_for(self, request: web.Request, *, pinnable: bool = True) -> EngineRank:
        """The rank that serves this request: the one its X-data-parallel-rank header
        names (where vLLM reads it: `pinnable`), else the least loaded."""
        pinned = header_rank(request.headers.get(RANK_HEADER)) if pinnable else None
        return self.engines[self.balancer.pick([e.load for e in self.engines], pinned)]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


STATE = web.AppKey("sim_state", SimState)
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
    from sim import kv_http, pooling_http, responses_http  # they use this module's state

    responses_http.add_routes(app)
    pooling_http.add_routes(app)
    kv_http.add_routes(app)
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
    """vLLM checks the key on /v1/* only (health, metrics, tokenize stay open)."""
    key = request.app[STATE].cfg.api_key
    if key and request.path.startswith("/v1/"):
        if request.headers.get("Authorization") != f"Bearer {key}":
            raise ApiError(401, "Unauthorized", "AuthenticationError")
    return await handler(request)


def error_response(e: ApiError) -> web.Response:
    return web.Response(
        status=e.status, body=orjson.dumps(e.body()), content_type="application/json"
    )


def error_type(status: int) -> str:
    try:
        name = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        name = "Unknown"
    return name if name.endswith("Error") else name + "Error"


async def json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise bad_request(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body


# -- generation ----------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion)


async def _generate(request: web.Request, parse: Parser) -> web.StreamResponse:
    state = request.app[STATE]
    faults = request_faults(request, state)
    if faults.status is not None:
        raise ApiError(faults.status, "injected fault", error_type(faults.status))
    if faults.garbage:
        return await garbage(request)
    req = parse(await json_body(request), state.tokenizer, state.cfg.limits)
    chat = parse is parse_chat
    meta = r.Meta(
        id=("chatcmpl-" if chat else "cmpl-") + os.urandom(16).hex(),
        created=int(time.time()),
        model=state.cfg.limits.model,
        fingerprint=state.fingerprint,
        chat=chat,
        return_token_ids=req.return_token_ids,
        include_usage=req.include_usage,
        role=req.role,
        reasoning=chat and state.cfg.reasoning,
        include_reasoning=req.include_reasoning,
        tools=chat and req.tool is not None,
    )
    engine = state.engine_for(request)
    return await serve_run(request, Run(state, engine, req, faults, meta), req.stream)


async def serve_run(request: web.Request, run: Run, stream: bool) -> web.StreamResponse:
    """Admit, generate (streamed or not), account: one generation's life on its engine."""
    engine = run.engine
    await engine.admit()
    run.begin()
    try:
        if stream:
            return await run.stream(request)
        return await run.complete(request)
    except Dropped:
        return web.Response(status=500)  # never sent: the transport is gone
    except ConnectionResetError:
        # The client went away between awaits; with handler_cancellation a
        # disconnect usually arrives as CancelledError instead (same outcome).
        return web.Response(status=499)
    finally:
        run.end()
        engine.release()


def request_faults(request: web.Request, state: SimState) -> FaultSpec:
    header = request.headers.get(FAULT_HEADER)
    if header is None:
        return state.cfg.faults
    try:
        return parse_fault_spec(header).over(state.cfg.faults)
    except FaultSpecError as e:
        raise bad_request(f"{FAULT_HEADER}: {e}") from None


async def garbage(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    resp.force_close()
    await resp.prepare(request)
    await resp.write(b"data: {this is not json\n\nevent: ???\n\n\x00\xff garbage\n\ndata: [[[\n\n")
    return resp


# -- tokenizer endpoints ---------------------------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await json_body(request)
    check_model(body, state.cfg.limits)
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
    check_model(body, state.cfg.limits)
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
    return ok({"object": "list", "data": [card]})


async def version(request: web.Request) -> web.Response:
    return ok({"version": "sim"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def ok(body: object) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")
