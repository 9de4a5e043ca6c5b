"""How the shim serves one POST /v1/responses: a streamed request that can be replayed
faithfully (dataplane/responses/request.py: replay_refusal) is served as the chat request
that generates the same tokens, so it gets chat's token-exact failover, and its client sees
Responses events (dataplane/responses/translate.py); every other request goes to the engine's
own /v1/responses (dataplane/responses/passthrough.py for streams)."""

from __future__ import annotations

import time
import uuid

import orjson

from dataplane.edge.validate import validate
from dataplane.request import ClientRequest, Endpoint
from dataplane.responses.events import ResponseEvents, skeleton
from dataplane.responses.request import as_chat, replay_refusal


def as_chat_exchange(client: ClientRequest) -> tuple[ClientRequest, bytes, ResponseEvents] | None:
    """The chat request, its bytes and the client's event writer; None: serve it as is."""
    if client.endpoint is not Endpoint.RESPONSES or not client.stream:
        return None
    if replay_refusal(client.body) is not None:
        return None
    chat = as_chat(client.body)
    response = skeleton(client.body, f"resp_{uuid.uuid4().hex[:16]}", int(time.time()))
    events = ResponseEvents(response, lambda prefix: f"{prefix}_{uuid.uuid4().hex[:16]}")
    return validate(chat, Endpoint.CHAT), orjson.dumps(chat), events
