"""aiohttp wiring of the Responses API: create, retrieve, cancel (and an opt-in delete).

Answers as vLLM 0.32's api_router.py and OpenAIServingResponses give them (with
``VLLM_ENABLE_RESPONSES_API_STORE=1``): an unknown id, or a ``previous_response_id``
this server does not hold, is ``404 Response with id '…' not found.`` (type
"invalid_request_error", param "response_id"); cancelling a response that is not
running in the background is ``400 Cannot cancel a synchronous response.``.
vLLM has no DELETE route (405); ``SimConfig.responses_delete`` adds OpenAI's.
"""

from __future__ import annotations

import os
from dataclasses import replace

from aiohttp import web

from sim import responses_api as ra
from sim.chat_template import Message
from sim.http_common import error_type, garbage, json_body, ok, request_faults, serve_run
from sim.protocol import ApiError, bad_request, check_model
from sim.responses_run import ResponsesRun
from sim.state import STATE


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
    if app[STATE].cfg.responses_delete:
        app.router.add_delete("/v1/responses/{response_id}", delete)


async def create(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    faults = request_faults(request, state)
    if faults.status is not None:
        raise ApiError(faults.status, "injected fault", error_type(faults.status))
    if faults.garbage:
        return await garbage(request)
    body = await json_body(request)
    adapter = state.loras.resolve(body.get("model"))  # a LoRA adapter's name runs under it
    limits = state.loras.limits(adapter)
    check_model(body, limits)
    earlier: list[Message] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise bad_request("'previous_response_id' must be a string", "previous_response_id")
        stored = state.responses.get(prev)
        if stored is None:
            raise ra.not_found(prev)
        earlier = ra.history(stored.messages, stored.response["output"])
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid:
        rid = "resp_" + os.urandom(8).hex()  # vLLM: "resp_" + random_uuid()
    req = ra.parse_responses(body, state.tokenizer, limits, response_id=rid, earlier=earlier)
    if not state.responses.enabled:
        req = replace(req, store=False)  # vLLM ignores store without its store variable
    # vLLM's Responses path never reads X-data-parallel-rank: always balanced.
    engine = state.engine_for(request, pinnable=False)
    run = ResponsesRun(state, engine, req, faults, adapter)
    return await serve_run(request, run, req.gen.stream)


async def retrieve(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rid = request.match_info["response_id"]
    stored = state.responses.get(rid)
    if stored is None:
        raise ra.not_found(rid)
    if request.query.get("stream", "").lower() in ("1", "true"):
        # vLLM replays events of background responses only; the sim has none.
        raise bad_request(f"Unknown response_id: {rid}", "response_id")
    return ok(stored.response)


async def cancel(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rid = request.match_info["response_id"]
    if state.responses.get(rid) is None:
        raise ra.not_found(rid)
    # Every stored response here finished before it was stored (no background mode).
    raise ApiError(400, "Cannot cancel a synchronous response.", "invalid_request_error",
                   "response_id")  # fmt: skip


async def delete(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rid = request.match_info["response_id"]
    if not state.responses.delete(rid):
        raise ra.not_found(rid)
    return ok({"id": rid, "object": "response", "deleted": True})
