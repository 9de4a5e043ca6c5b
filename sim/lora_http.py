"""vLLM 0.32's LoRA routes on the sim, and the adapters' cards on GET /v1/models.

* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"?}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` exist only when the process was
  started with VLLM_ALLOW_RUNTIME_LORA_UPDATING true (else 404, as vLLM's unattached
  routes). Success is 200 with vLLM's plain text (``Success: LoRA adapter 'NAME' added
  successfully.`` / ``... removed successfully.``); a failure is the usual error JSON with
  vLLM's status and type: 400 InvalidUserInput (a name or path empty, the base model's
  name, already loaded without load_inplace), 404 NotFoundError (unloading an unknown
  name; loading from a directory without adapter_config.json, the path shown as
  ``<path>``), 500 InternalServerError (an adapter_config.json vLLM refuses, no weights
  file, LoRA not enabled). A body FastAPI would refuse (not JSON, a field missing or of
  the wrong type) is vLLM's 400 "Bad Request" with pydantic's error list.
* ``/v1/models`` lists each registered adapter after the base model: id its name, root
  its path, parent the base model (and no max_model_len), in the order they were loaded.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from sim.http_common import json_body
from sim.protocol import ApiError
from sim.state import STATE, SimState

_JSON_ONLY = "Unsupported Media Type: Only 'application/json' is allowed"
_BOOL_WORDS = {"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"}


def add_routes(app: web.Application) -> None:
    state = app[STATE]
    if state.cfg.runtime_lora_updating:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    if state.cfg.lora is not None and state.cfg.lora.modules:
        app.on_startup.append(_load_static)


async def _load_static(app: web.Application) -> None:
    await app[STATE].loras.load_static()


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request, {"lora_name": str, "lora_path": str, "load_inplace": bool,
                                 "is_3d_lora_weight": bool})  # fmt: skip
    loras = request.app[STATE].loras
    inplace = bool(_true(body.get("load_inplace")))
    text = await loras.load(body["lora_name"], body["lora_path"], inplace)
    return web.Response(text=text)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request, {"lora_name": str})
    return web.Response(text=await request.app[STATE].loras.unload(body["lora_name"]))


def cards(state: SimState) -> list[dict[str, Any]]:
    """The adapters' ModelCards, as vLLM's show_available_models adds them."""
    created = int(time.time())  # vLLM's card default: the time of the listing
    return [
        {"id": a.name, "object": "model", "created": created, "owned_by": "sim", "root": a.path,
         "parent": a.parent, "max_model_len": None, "permission": []}
        for a in state.loras.registry.adapters()
    ]  # fmt: skip


# -- the body, as FastAPI and pydantic check it -----------------------------------------
async def _body(request: web.Request, fields: Mapping[str, type]) -> dict[str, Any]:
    """The JSON body; vLLM's 400 for what its validate_json_request and the request model
    refuse. ``fields``: the model's, the first two (the names) required."""
    media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise _validation([_JSON_ONLY])
    body = await json_body(request)
    errors: list[dict[str, Any] | str] = []
    for i, (key, kind) in enumerate(fields.items()):
        if key not in body:
            if kind is str and i < 2:
                errors.append(_error("missing", key, "Field required", _summary(body)))
            continue
        value = body[key]
        if kind is str and not isinstance(value, str):
            errors.append(_error("string_type", key, "Input should be a valid string",
                                 _summary(value)))  # fmt: skip
        elif kind is bool and _true(value) is None:
            errors.append(_error("bool_type", key, "Input should be a valid boolean",
                                 _summary(value)))  # fmt: skip
    if errors:
        raise _validation(errors)
    return body


def _true(value: object) -> bool | None:
    """pydantic's lax bool: true/false, 0/1 and its words; None when it is none of them."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return value == 1
    if isinstance(value, str) and value.lower() in _BOOL_WORDS:
        return value.lower() in ("1", "on", "t", "true", "y", "yes")
    return None


def _error(kind: str, key: str, msg: str, given: object) -> dict[str, Any]:
    return {"type": kind, "loc": f"body.{key}", "msg": msg, "input": given}


def _summary(value: object) -> object:
    """vLLM's _summarize_error_input: containers by their size, anything else as text."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def _validation(errors: list[dict[str, Any] | str]) -> ApiError:
    """vLLM's validation_exception_handler: each error on a line, param the first's loc."""
    label = "error" if len(errors) == 1 else "errors"
    lines = "".join(f"  {e}\n" for e in errors[:10])
    more = f"  ...and {len(errors) - 10} more {label}\n" if len(errors) > 10 else ""
    message = f"{len(errors)} validation {label}:\n{lines}{more}".rstrip()
    first = errors[0]
    param = first["loc"] if isinstance(first, dict) else None
    return ApiError(400, message, "Bad Request", param)
