"""Each model's think tags as token ids, asked of an engine once per shim and kept: a
resume follows the reasoning/content split by these ids (dataplane/reasoning.py)."""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp
import orjson

from baton.model import Backend
from dataplane.resume.reasoning import THINK_TAGS, Markers

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
        start, end = [await self._one_id(backend, tag) for tag in tags]
        if start is None or end is None:
            log.warning("%s: %s's tags %s are not single tokens there; its reasoning will not "
                        "be resumed", backend.id, backend.reasoning_parser, tags)  # fmt: skip
            return None
        return Markers(start, end, tags[1])

    async def _one_id(self, backend: Backend, text: str) -> int | None:
        body = {"model": backend.model, "prompt": text, "add_special_tokens": False}
        async with self._session.post(
            backend.url + "/tokenize",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **backend.call_headers(os.environ)},
            timeout=aiohttp.ClientTimeout(total=LOOKUP_TIMEOUT_S),
        ) as resp:
            if resp.status != 200:
                raise ValueError(f"/tokenize answered {resp.status}")
            tokens = orjson.loads(await resp.read()).get("tokens")
        ok = isinstance(tokens, list) and len(tokens) == 1 and type(tokens[0]) is int
        return tokens[0] if ok else None
