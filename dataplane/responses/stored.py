"""Retrieve, delete and cancel a stored response: `GET /v1/responses/{id}`, `DELETE
/v1/responses/{id}`, `POST /v1/responses/{id}/cancel`. Each must reach the one engine that
holds the response, so control routes it by ownership (its pin) or refuses it saying where
the response was (dataplane/refusals.py); another engine would answer a misleading 404."""

from __future__ import annotations

import logging
import uuid
from typing import Protocol

import aiohttp
from aiohttp import web

from baton.model import Backend, RequestShape
from dataplane.exceptions import AttemptFailed, ControlUnavailable, ErrorKind, OpenAIError
from dataplane.link.needs import Outcomes, Ownership, Routing
from dataplane.outcomes import UNSERVED, outcome
from dataplane.refusals import refusal
from dataplane.settings import Timeouts
from dataplane.upstream.engine import call

log = logging.getLogger("baton.shim.responses")


class StoredControl(Routing, Outcomes, Ownership, Protocol):
    """What a stored response's follow-up asks of control."""


class StoredResponses:
    def __init__(
        self, session: aiohttp.ClientSession, control: StoredControl, timeouts: Timeouts
    ) -> None:
        self._session = session
        self._control = control
        self._timeouts = timeouts

    async def serve(self, request: web.Request) -> web.Response:
        key = request.match_info["response_id"]
        path = request.path + (f"?{request.query_string}" if request.query_string else "")
        rid = uuid.uuid4().hex
        try:
            backend = await self._owner(rid, key)
        except OpenAIError as refusal:
            return _error(refusal)
        try:
            status, body, ctype = await call(
                self._session, backend, request.method, path, self._timeouts
            )
        except AttemptFailed as failed:
            await self._control.attempt_failed(rid, backend.id, failed.failure, failed.detail)
            self._control.finished(outcome(rid, backend.id, "", UNSERVED))
            why = f"backend {backend.id}, which holds {key}, did not answer ({failed})"
            return _error(OpenAIError(ErrorKind.BACKEND_FAILED, why))
        # An engine's 4xx (no such response) is an answer: the backend served it.
        self._control.finished(outcome(rid, backend.id, "", status, ok=status < 500))
        if request.method == "DELETE" and status == 200:
            try:
                await self._control.record_owner(rid, key, backend.id, "", released=True)
            except ControlUnavailable as exc:
                log.warning("request %s: %s deleted; control not told (%s)", rid, key, exc)
        headers = {"X-Request-Id": rid}
        return web.Response(body=body, status=status, headers={**headers, "Content-Type": ctype})

    async def _owner(self, rid: str, key: str) -> Backend:
        """The backend holding `key`, or OpenAIError saying why there is none."""
        shape = RequestShape(model="", owner_key=key, greedy=False, sets_temperature=False)
        try:
            decision = await self._control.route(rid, shape)
        except ControlUnavailable as exc:
            raise OpenAIError(ErrorKind.CONTROL_UNAVAILABLE, str(exc)) from None
        if not decision.backends:
            raise refusal(decision, "")
        return decision.backends[0]


def _error(err: OpenAIError) -> web.Response:
    return web.Response(body=err.json(), status=err.status, content_type="application/json")
