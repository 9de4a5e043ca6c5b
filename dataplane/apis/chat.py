"""Chat completions and completions: the APIs every other generating API is served as, or
beside. Their streams are relayed, and resumed on failure, by dataplane/relay/stream.py."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import orjson

from dataplane.apis.answers import garbage
from dataplane.apis.api import AsChat, Plain, Prompt
from dataplane.apis.fields import check_params, client_request, prompt_of
from dataplane.exceptions import bad_request
from dataplane.request import ClientRequest, Endpoint, is_int
from dataplane.sse import ClientStream
from dataplane.upstream.chunks import choice_text_whole

ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})


def _check_content(content: list[Any], param: str) -> None:
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{param}.content[{j}] must be an object with a 'type'",
                              f"{param}.content[{j}]")  # fmt: skip
        # The shim measures text parts for the request's shape.
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise bad_request(f"{param}.content[{j}].text must be a string",
                              f"{param}.content[{j}].text")  # fmt: skip


def check_messages(messages: Any) -> None:
    if messages is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{param} must be an object", param)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"{param}.role must be one of {', '.join(sorted(ROLES))}",
                              f"{param}.role")  # fmt: skip
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            continue
        if not isinstance(content, str | list):
            raise bad_request(f"{param}.content must be a string or an array of parts",
                              f"{param}.content")  # fmt: skip
        if isinstance(content, list):
            _check_content(content, param)


def check_prompt(prompt: Any) -> None:
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(is_int(p) for p in prompt):
            return
        if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
            return
    raise bad_request("'prompt' must be a string, an array of strings or an array of token ids",
                      "prompt")  # fmt: skip


def choices(obj: Any) -> list[dict[str, Any]]:
    found = obj.get("choices") if isinstance(obj, dict) else None
    if not (isinstance(found, list) and found and all(isinstance(c, dict) for c in found)):
        raise garbage("a 200 answer without choices")
    return cast(list[dict[str, Any]], found)


class Chat(Plain):
    pins = True

    def check(self, body: Mapping[str, Any]) -> None:
        check_messages(body.get("messages"))
        check_params(body)

    def prompt(self, body: Mapping[str, Any]) -> Prompt:
        return prompt_of(body["messages"])

    def answer(self, obj: Any) -> str | None:
        return choice_text_whole(choices(obj)[0]) or None


class Completions(Plain):
    def check(self, body: Mapping[str, Any]) -> None:
        check_prompt(body.get("prompt"))
        check_params(body)

    def prompt(self, body: Mapping[str, Any]) -> Prompt:
        # A completion prompt is one "message" for affinity purposes.
        prompt = body["prompt"]
        return Prompt([prompt], (False,), len(prompt) if isinstance(prompt, str | list) else 0)

    def answer(self, obj: Any) -> str | None:
        choices(obj)
        return None


CHAT = Chat()
COMPLETIONS = Completions()


def served_as_chat(
    client: ClientRequest, chat: dict[str, Any], events: Callable[[ClientStream], ClientStream]
) -> AsChat:
    """`client` served as `chat` (the request its API converts it to), its client's stream
    written by `events`; the chat request is checked as any chat request is."""
    CHAT.check(chat)
    return AsChat(client_request(Endpoint.CHAT, chat, client.model), orjson.dumps(chat), events)
