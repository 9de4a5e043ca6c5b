"""What every route module of the sim shares: JSON in and out, the one error shape,
per-request faults, and serving a generation (sim.run) on its engine.

Kept out of sim.server so the route modules (sim.*_http) never import the module that
assembles them. Named so as not to shadow the standard library's `http`.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from sim.faults import FaultSpec, FaultSpecError, parse_fault_spec
from sim.protocol import ApiError, bad_request
from sim.run import Dropped, Run
from sim.state import SimState

FAULT_HEADER = "X-Sim-Fault"


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


async def serve_run(request: web.Request, run: Run, stream: bool) -> web.StreamResponse:
    """Admit, generate (streamed or not), account: one generation's life on its engine."""
    engine = run.engine
    await engine.admit(run.adapter)
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
        engine.release(run.adapter)


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


def ok(body: object) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")
