"""Read a backend's facts over HTTP (`GET /server_info`), for binding, gating and refresh,
its context length (`GET /v1/models`) and its /metrics page (load, data-parallel ranks)."""

from __future__ import annotations

import os

import aiohttp
import orjson

from baton.model import Backend
from control.exceptions import FactsError
from control.facts import FACTS_PATH, Facts, facts_from_server_info


async def _get(
    session: aiohttp.ClientSession, backend: Backend, path: str, timeout: float
) -> tuple[int, str]:
    """One GET of the engine with its own headers: (status, body text). Raises what aiohttp
    and the timeout raise (callers say what a silent engine means to them)."""
    async with session.get(
        backend.url + path,
        headers=backend.call_headers(os.environ),
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as resp:
        return resp.status, await resp.text()


_UNANSWERED = (aiohttp.ClientError, TimeoutError, UnicodeDecodeError)


async def fetch_max_model_len(
    session: aiohttp.ClientSession, backend: Backend, timeout: float = 2.0
) -> int | None:
    """The engine's context length for the backend's model from its `GET /v1/models` (vLLM
    and SGLang say `max_model_len`); None when it does not say."""
    try:
        status, text = await _get(session, backend, "/v1/models", timeout)
        body = orjson.loads(text) if status == 200 else None
    except (*_UNANSWERED, orjson.JSONDecodeError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    models = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    mine = next((m for m in models if m.get("id") == backend.model), None)
    length = (mine or (models[0] if len(models) == 1 else {})).get("max_model_len")
    usable = isinstance(length, int) and not isinstance(length, bool) and length > 0
    return length if usable else None


async def fetch_facts(
    session: aiohttp.ClientSession, backend: Backend, timeout: float = 2.0
) -> Facts:
    """Raises FactsError naming the backend when it can't say (no endpoint, down, junk)."""
    try:
        status, text = await _get(session, backend, FACTS_PATH, timeout)
    except _UNANSWERED as exc:
        raise FactsError(f"facts: {backend.id} unreachable ({type(exc).__name__})") from exc
    if status != 200:
        raise FactsError(f"facts: {backend.id} answered {FACTS_PATH} with {status}")
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        raise FactsError(f"facts: {backend.id} sent no JSON object")
    try:
        return facts_from_server_info(body)
    except FactsError as exc:
        raise FactsError(f"facts: {backend.id}: {exc}") from exc


async def fetch_metrics_page(
    session: aiohttp.ClientSession, backend: Backend, timeout: float
) -> str | None:
    """The engine's /metrics page; None when it does not answer with one."""
    try:
        status, text = await _get(session, backend, "/metrics", timeout)
    except _UNANSWERED:
        return None
    return text if status == 200 else None
