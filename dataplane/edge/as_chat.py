"""How the shim serves one POST /v1/responses or /v1/messages: a streamed request that can be
replayed faithfully (dataplane/responses/request.py, dataplane/messages/request.py:
replay_refusal) is served as the chat request that generates the same tokens, so it gets
chat's token-exact failover, and its client sees its own API's events
(dataplane/responses/translate.py, dataplane/messages/translate.py); every other request goes
to the engine's own endpoint (the passthrough relays for streams)."""

from __future__ import annotations

import time
import uuid

import orjson

from dataplane.edge.validate import validate
from dataplane.messages import request as messages
from dataplane.messages.events import MessageEvents
from dataplane.request import ClientRequest, Endpoint
from dataplane.responses.events import ResponseEvents, skeleton
from dataplane.responses.request import as_chat, replay_refusal


def as_chat_exchange(
    client: ClientRequest,
) -> tuple[ClientRequest, bytes, ResponseEvents | MessageEvents] | None:
    """The chat request, its bytes and the client's event writer; None: serve it as is."""
    if not client.stream:
        return None
    if client.endpoint is Endpoint.MESSAGES:
        if messages.replay_refusal(client.body) is not None:
            return None
        chat = messages.as_chat(client.body)
        return validate(chat, Endpoint.CHAT), orjson.dumps(chat), MessageEvents()
    if client.endpoint is not Endpoint.RESPONSES or replay_refusal(client.body) is not None:
        return None
    chat = as_chat(client.body)
    response = skeleton(client.body, f"resp_{uuid.uuid4().hex[:16]}", int(time.time()))
    events = ResponseEvents(response, lambda prefix: f"{prefix}_{uuid.uuid4().hex[:16]}")
    return validate(chat, Endpoint.CHAT), orjson.dumps(chat), events
