"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) at the edge:
Anthropic's error shapes, its version and beta headers passed to the engine, its checks and
replay rules (dataplane/messages/request.py), a replayable stream served as chat with
Anthropic events (dataplane/messages/translate.py), and how an engine's own Messages stream
is read and cut."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dataplane.apis.answers import garbage, usage_counts
from dataplane.apis.api import RELAYED, AsChat, EngineStream, Plain, Prompt
from dataplane.apis.chat import served_as_chat
from dataplane.apis.fields import check_params, prompt_of
from dataplane.apis.oneshot import OneShot
from dataplane.exceptions import ErrorShape
from dataplane.messages import request
from dataplane.messages.events import MessageEvents, error_event
from dataplane.messages.translate import ChatAsMessages
from dataplane.request import ClientRequest
from dataplane.upstream import genai
from dataplane.upstream.genai import Attributes

HEADERS = ("anthropic-version", "anthropic-beta")  # they go to the engine with the request
# Events after which an engine's Messages stream has nothing more to say (True: complete).
TERMINAL = {"message_stop": True, "error": False}


class MessagesStream:
    """An engine's own Messages stream (EngineStream)."""

    noun = "message"

    def __init__(self, client: ClientRequest) -> None:
        self.why = request.replay_refusal(client.body) or RELAYED
        self.deltas = 0
        self.message: dict[str, Any] | None = None  # message_start's, for the span
        self.stop_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def see(self, obj: Mapping[str, Any]) -> str:
        kind = str(obj.get("type", ""))
        if kind == "content_block_delta":
            self.deltas += 1
        elif kind == "message_start" and isinstance(obj.get("message"), dict):
            self.message = obj["message"]
        elif kind == "message_delta":
            delta, usage = obj.get("delta"), obj.get("usage")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self.stop_reason = delta["stop_reason"]
            if isinstance(usage, dict):
                self.usage = usage
        return kind

    def announces(self, obj: Mapping[str, Any]) -> str | None:
        return None  # nothing of a message is stored on its engine

    def end(self, kind: str) -> bool | None:
        return TERMINAL.get(kind)

    def failure(self, message: str) -> bytes:
        return error_event("api_error", message)

    def result(self) -> tuple[Attributes, int, int]:
        message = self.message or {}
        inputs = usage_counts(message)[0]
        outputs = usage_counts({"usage": self.usage})[1]
        attrs = genai.result_attributes(message.get("id"), message.get("model"),
                                        (self.stop_reason,), inputs, outputs)  # fmt: skip
        return attrs, inputs, outputs


class Messages(Plain):
    errors = ErrorShape.ANTHROPIC
    forwarded = HEADERS

    def check(self, body: Mapping[str, Any]) -> None:
        request.check_messages(body)
        check_params(body)

    def prompt(self, body: Mapping[str, Any]) -> Prompt:
        return prompt_of(request.hashed_messages(body))  # as chat's, where Baton converts them

    def as_chat(self, client: ClientRequest) -> AsChat | None:
        if not client.stream or request.replay_refusal(client.body) is not None:
            return None
        events = MessageEvents()
        chat = request.as_chat(client.body)
        return served_as_chat(client, chat, lambda out: ChatAsMessages(out, events))

    def answer(self, obj: Any) -> str | None:
        if not (isinstance(obj, dict) and obj.get("type") == "message"
                and isinstance(obj.get("content"), list)):
            raise garbage("a 200 answer that is not a message")  # fmt: skip
        return None

    def engine_stream(self, client: ClientRequest) -> EngineStream:
        return MessagesStream(client)


def _count_only(body: Mapping[str, Any]) -> None:
    request.check_messages(body, count_only=True)


MESSAGES = Messages()
COUNT_TOKENS = OneShot(_count_only, "input_tokens", int, ErrorShape.ANTHROPIC, HEADERS)
