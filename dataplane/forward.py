"""One upstream attempt: open the request to a backend and return the response once its
status line has arrived, or raise AttemptFailed with the failure class. Nothing here decides
whether to retry (that is failover.py) or touches the client (that is proxy.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import aiohttp

from baton.model import Backend
from dataplane.failover import Failure


class AttemptFailed(Exception):
    def __init__(self, failure: Failure, detail: str) -> None:
        super().__init__(f"{failure}: {detail}")
        self.failure = failure
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float = 3.0
    # Between reads of the upstream response: bounds a silent backend. Stall detection
    # with separate first-token / inter-token timeouts belongs to the resume path.
    read: float = 600.0


JSON_HEADERS = {"Content-Type": "application/json"}


def classify_exception(exc: BaseException) -> AttemptFailed:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return AttemptFailed(Failure.CONNECT, str(exc.os_error.strerror or exc.os_error))
    if isinstance(exc, TimeoutError):
        return AttemptFailed(Failure.TIMEOUT, "backend did not answer in time")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return AttemptFailed(Failure.DISCONNECT, type(exc).__name__)
    return AttemptFailed(Failure.DISCONNECT, f"{type(exc).__name__}: {exc}")


async def open_attempt(
    session: aiohttp.ClientSession,
    backend: Backend,
    path: str,
    body: bytes,
    timeouts: Timeouts,
    headers: dict[str, str] | None = None,
) -> aiohttp.ClientResponse:
    """The caller owns the returned response and must release or close it. `headers`:
    extra ones (the trace context, so the engine's own spans join the request's trace).
    Headers are built here from scratch: nothing of the client's request (its Authorization
    above all) goes upstream; the backend gets its own key, when it has one."""
    extra = {**(headers or {}), **backend.auth_headers(os.environ)}
    try:
        return await session.post(
            backend.url + path,
            data=body,
            headers={**JSON_HEADERS, **extra} if extra else JSON_HEADERS,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=timeouts.connect, sock_read=timeouts.read
            ),
        )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise classify_exception(exc) from exc
