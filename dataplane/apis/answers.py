"""A whole 200 answer, checked by its API before it is relayed as a success (nothing has
reached the client yet, so a garbled answer is retried on the next backend like any other
failure), and the token counts in any API's usage."""

# baton: pure

from __future__ import annotations

from typing import Any

import orjson

from baton.model import Failure
from dataplane.apis.api import Api
from dataplane.exceptions import AttemptFailed
from dataplane.request import is_int


def check_answer(api: Api, body: bytes) -> tuple[dict[str, Any], str | None]:
    """The answer (AttemptFailed(GARBAGE) when it cannot be relayed as a success), and the
    assistant's text when it pins the next turn (a chat answer's choice 0)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise AttemptFailed(Failure.GARBAGE, "a 200 answer that is not JSON") from None
    reply = api.answer(obj)
    return obj, reply


def garbage(why: str) -> AttemptFailed:
    return AttemptFailed(Failure.GARBAGE, why)


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
        if is_int(v) and v >= 0:
            return v
    return 0
