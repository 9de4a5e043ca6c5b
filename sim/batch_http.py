"""/v1/completions with a batch of prompts, as vLLM 0.32 answers it (its completion serving:
`prompt` a list of prompts, each its own engine request, added at once; the answer whole,
one choice per prompt in prompt order, `index` its place, `usage` summed over them). The
speculative rounds send their k + 1 verification prefixes so (issue 44). The sim answers a
batch whole only: a streamed batch is refused (one prompt per streamed request)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from sim.protocol import bad_request

One = Callable[[dict[str, Any]], Awaitable[web.StreamResponse]]


def batch_of(prompt: object) -> list[Any] | None:
    """The prompts of a batch (two or more, each text or token ids), or None for one prompt
    (a batch of one is one prompt, as vLLM takes it)."""
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return list(prompt)
    return None


async def complete_batch(body: dict[str, Any], prompts: list[Any], one: One) -> web.Response:
    """Each prompt generated as its own request, at once; their answers as one."""
    if body.get("stream"):
        raise bad_request("the sim answers a batch of prompts whole: stream=true takes one "
                          "prompt", "prompt")  # fmt: skip
    answers = await asyncio.gather(*(one({**body, "prompt": p}) for p in prompts))
    bodies = []
    for answer in answers:
        if answer.status != 200 or not isinstance(answer, web.Response):
            return answer  # type: ignore[return-value]  # the first prompt refused: its error
        bodies.append(orjson.loads(answer.body))  # type: ignore[arg-type]
    merged = dict(bodies[0])
    merged["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    usage = [b.get("usage") or {} for b in bodies]
    merged["usage"] = {k: sum(u.get(k, 0) for u in usage)
                       for k in ("prompt_tokens", "completion_tokens", "total_tokens")}  # fmt: skip
    return web.Response(body=orjson.dumps(merged), content_type="application/json")
