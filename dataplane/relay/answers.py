"""What a whole 200 answer must be to be relayed as a success, per endpoint. Nothing has
reached the client when it is checked, so a garbled answer is retried on the next backend
like any other failure, never relayed as a 200."""

# baton: pure

from __future__ import annotations

from typing import Any, cast

import orjson

from baton.model import Failure
from dataplane.exceptions import AttemptFailed
from dataplane.relay.oneshot import garbled
from dataplane.request import ClientRequest, Endpoint
from dataplane.upstream.chunks import choice_text_whole


def check_answer(client: ClientRequest, body: bytes) -> tuple[dict[str, Any], str | None]:
    """Checks a 200 answer (AttemptFailed(GARBAGE) when it cannot be relayed as a success);
    returns it, and the assistant's text of a chat answer (choice 0) for the next turn's
    pin."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise AttemptFailed(Failure.GARBAGE, "a 200 answer that is not JSON") from None
    if client.endpoint is Endpoint.RESPONSES:
        if not (isinstance(obj, dict) and isinstance(obj.get("id"), str)
                and isinstance(obj.get("output"), list)):
            raise AttemptFailed(Failure.GARBAGE, "a 200 answer without id and output")  # fmt: skip
        return obj, None
    if client.endpoint is Endpoint.MESSAGES:
        if not (isinstance(obj, dict) and obj.get("type") == "message"
                and isinstance(obj.get("content"), list)):
            raise AttemptFailed(Failure.GARBAGE, "a 200 answer that is not a message")  # fmt: skip
        return obj, None
    if not client.endpoint.generates:
        why = garbled(client.endpoint, obj)
        if why is not None:
            raise AttemptFailed(Failure.GARBAGE, why)
        return obj, None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
        raise AttemptFailed(Failure.GARBAGE, "a 200 answer without choices")
    if client.endpoint is not Endpoint.CHAT:
        return obj, None
    return obj, choice_text_whole(cast(dict[str, Any], choices[0])) or None


def usage_counts(answer: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer's usage, in any of the APIs' spellings
    (chat and completions: prompt_/completion_tokens; Responses and Messages: input_/
    output_tokens; embeddings: prompt_tokens alone); 0 for what it does not say."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    return _count(usage, "prompt_tokens", "input_tokens"), _count(
        usage, "completion_tokens", "output_tokens"
    )


def _count(usage: dict[str, Any], *names: str) -> int:
    for name in names:
        v = usage.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return 0
