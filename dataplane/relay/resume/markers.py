"""Each model's think tags as token ids, asked of an engine once per shim and kept: a
resume follows the reasoning/content split by these ids (dataplane/relay/resume/reasoning.py).

Two questions per tag, each answered by the engine itself:
- its id: /tokenize of the tag's text, which must be one token;
- what a stream shows for it: a one-token /v1/completions whose only allowed token is the
  tag (vLLM's allowed_token_ids), decoded as streams are by default (skip_special_tokens):
  the tag's text when it is an ordinary added token (DeepSeek-R1, Qwen3), "" when the
  tokenizer marks it special. That answer also proves the id is the tag's.
Any other answer, or an engine that refuses the question, leaves the model unfollowed, and
a reasoning stream on it is refused a resume, explicitly."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import aiohttp
import orjson

from baton.model import Backend
from dataplane.relay.resume.reasoning import THINK_TAGS, Markers

log = logging.getLogger("baton.shim.markers")
LOOKUP_TIMEOUT_S = 5.0


class MarkerCache:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        # (model, parser) -> the tags, or None when the engine's tokenizer has no such
        # single-token tags (that answer is final; a failed call is asked again).
        self._known: dict[tuple[str, str], Markers | None] = {}
        self._asking: dict[tuple[str, str], asyncio.Future[Markers | None]] = {}

    async def get(self, backend: Backend) -> Markers | None:
        """The tags of the parser `backend` runs, None when Baton cannot follow it."""
        tags = THINK_TAGS.get(backend.reasoning_parser)
        if tags is None:
            return None
        key = (backend.model, backend.reasoning_parser)
        if key in self._known:
            return self._known[key]
        asking = self._asking.get(key)
        if asking is None:  # one lookup at a time per model, shared by its requests
            asking = self._asking[key] = asyncio.ensure_future(self._ask(backend, tags))
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        try:
            markers = await asyncio.shield(asking)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("think tags of %s from %s: %s", backend.model, backend.id, exc)
            return None
        self._known[key] = markers
        return markers

    async def _ask(self, backend: Backend, tags: tuple[str, str]) -> Markers | None:
        start, end = await asyncio.gather(*(self._one_id(backend, tag) for tag in tags))
        if start is None or end is None:
            log.warning("%s: %s's tags %s are not single tokens there; its reasoning will not "
                        "be resumed", backend.id, backend.reasoning_parser, tags)  # fmt: skip
            return None
        shown = await asyncio.gather(*(self._shown(backend, t, start) for t in (start, end)))
        # Each shows its text or nothing, and both alike: the tags are of one kind.
        kept = [text == tag for text, tag in zip(shown, tags, strict=True)]
        skipped = [text == "" for text in shown]
        if not (all(kept) or all(skipped)):
            log.warning("%s: generating %s's tags %s shows %s; its reasoning will not be "
                        "resumed", backend.id, backend.reasoning_parser, tags, shown)  # fmt: skip
            return None
        return Markers(start, end, tags[0], tags[1], special=all(skipped))

    def _post(self, backend: Backend, path: str, body: dict[str, object]) -> Any:
        return self._session.post(
            backend.url + path,
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **backend.call_headers(os.environ)},
            timeout=aiohttp.ClientTimeout(total=LOOKUP_TIMEOUT_S),
        )

    async def _one_id(self, backend: Backend, text: str) -> int | None:
        body = {"model": backend.model, "prompt": text, "add_special_tokens": False}
        async with self._post(backend, "/tokenize", body) as resp:
            if resp.status != 200:
                raise ValueError(f"/tokenize answered {resp.status}")
            tokens = orjson.loads(await resp.read()).get("tokens")
        ok = isinstance(tokens, list) and len(tokens) == 1 and type(tokens[0]) is int
        return tokens[0] if ok else None

    async def _shown(self, backend: Backend, tag_id: int, prompt_id: int) -> str | None:
        """The text a default-decoded stream shows when the engine generates `tag_id`; None
        when it did not generate that token."""
        body = {
            "model": backend.model, "prompt": [prompt_id], "max_tokens": 1, "temperature": 0,
            "allowed_token_ids": [tag_id], "return_token_ids": True,
        }  # fmt: skip
        async with self._post(backend, "/v1/completions", body) as resp:
            if resp.status != 200:
                raise ValueError(f"/v1/completions with allowed_token_ids answered {resp.status}")
            answer = orjson.loads(await resp.read())
        choice = (answer.get("choices") or [{}])[0]
        text, ids = choice.get("text"), choice.get("token_ids")
        if not isinstance(text, str) or (ids is not None and ids != [tag_id]):
            return None
        return text
