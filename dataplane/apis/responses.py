"""The Responses API (POST /v1/responses) at the edge: its checks and replay rules
(dataplane/responses/request.py), a replayable stream served as chat with Responses events
(dataplane/responses/translate.py), a stored response's id told to control before its client
learns it, and how an engine's own Responses stream is read and cut."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from dataplane.apis.answers import garbage, usage_counts
from dataplane.apis.api import RELAYED, AsChat, EngineStream, Plain, Prompt
from dataplane.apis.chat import served_as_chat
from dataplane.apis.fields import check_params, prompt_of
from dataplane.request import ClientRequest, is_int, token_limit
from dataplane.responses import request
from dataplane.responses.events import ResponseEvents, failed_event, skeleton
from dataplane.responses.translate import ChatAsResponses
from dataplane.upstream import genai
from dataplane.upstream.genai import Attributes

# Events after which an engine's Responses stream has nothing more to say (True: complete).
TERMINAL = {"response.completed": True, "response.incomplete": True, "response.failed": False,
            "error": False}  # fmt: skip


class ResponsesStream:
    """An engine's own Responses stream (EngineStream)."""

    noun = "response"

    def __init__(self, client: ClientRequest) -> None:
        self.why = request.replay_refusal(client.body) or RELAYED
        self._stored = request.stored(client.body)
        self._created: dict[str, Any] | None = None  # the response object it announced
        self._seq = -1  # the last sequence_number relayed
        self.deltas = 0
        self.response: dict[str, Any] | None = None  # the last response object it carried

    def see(self, obj: Mapping[str, Any]) -> str:
        kind = str(obj.get("type", ""))
        if isinstance(obj.get("sequence_number"), int):
            self._seq = obj["sequence_number"]
        if kind == "response.output_text.delta":
            self.deltas += 1
        response = obj.get("response")
        if isinstance(response, dict):
            if kind == "response.created":
                self._created = response
            self.response = response
        return kind

    def announces(self, obj: Mapping[str, Any]) -> str | None:
        response = obj.get("response")
        if self._stored and obj.get("type") == "response.created" and isinstance(
            response, dict) and isinstance(response.get("id"), str):  # fmt: skip
            return str(response["id"])
        return None

    def end(self, kind: str) -> bool | None:
        return TERMINAL.get(kind)

    def failure(self, message: str) -> bytes:
        return failed_event(self._created, self._seq + 1, message)

    def result(self) -> tuple[Attributes, int, int]:
        return genai.answer_attributes(self.response), *usage_counts(self.response)


class Responses(Plain):
    def check(self, body: Mapping[str, Any]) -> None:
        request.check_responses(body)
        check_params(body)

    def prompt(self, body: Mapping[str, Any]) -> Prompt:
        # Its messages hash as a chat request's do: the same prefix warms the same cache
        # (input that is not plain messages hashes item by item).
        return prompt_of(request.messages_of(body) or list(body["input"]))

    def owner_key(self, body: Mapping[str, Any]) -> str:
        return str(body.get("previous_response_id") or "")

    def output_cap(self, body: Mapping[str, Any]) -> int | None:
        cap = token_limit(body)
        limit = body.get("max_output_tokens")
        return cap if cap is not None else limit if is_int(limit) else None

    def as_chat(self, client: ClientRequest) -> AsChat | None:
        if not client.stream or request.replay_refusal(client.body) is not None:
            return None
        response = skeleton(client.body, f"resp_{uuid.uuid4().hex[:16]}", int(time.time()))
        events = ResponseEvents(response, lambda prefix: f"{prefix}_{uuid.uuid4().hex[:16]}")
        chat = request.as_chat(client.body)
        return served_as_chat(client, chat, lambda out: ChatAsResponses(out, events))

    def answer(self, obj: Any) -> str | None:
        if not (isinstance(obj, dict) and isinstance(obj.get("id"), str)
                and isinstance(obj.get("output"), list)):
            raise garbage("a 200 answer without id and output")  # fmt: skip
        return None

    def owned(self, client: ClientRequest, answer: Mapping[str, Any]) -> str | None:
        return str(answer["id"]) if request.stored(client.body) else None

    def engine_stream(self, client: ClientRequest) -> EngineStream:
        return ResponsesStream(client)


RESPONSES = Responses()
