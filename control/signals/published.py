"""Read a backend's facts over HTTP from what its engine publishes, per engine kind (for
binding, gating and refresh), its context length (`GET /v1/models`) and its /metrics page
(load, data-parallel ranks).

- vllm (and the sim): the tokenizer through /tokenize (return_token_strs) and /detokenize;
  the vocab size is the first id /detokenize cannot spell; the block size from /metrics
  (`vllm:cache_config_info{block_size=...}`).
- openai (llama-server): /tokenize (with_pieces) and /detokenize; the vocab size from
  /v1/models `meta.n_vocab`; no block size (no paged KV cache).
- sglang (from its documented endpoints, untested here): /tokenize and /detokenize
  (skip_special_tokens false), the vocab size as vllm, `page_size` from /get_server_info.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiohttp
import orjson

from baton.model import Backend, BackendKind
from control.exceptions import FactsError
from control.signals.facts import (
    MAX_VOCAB,
    PROBE_CORPUS,
    SWEEP_CHUNK,
    Facts,
    Sweep,
    block_size_from_metrics,
    chunk_with_separator,
)

CALLS_AT_ONCE = 4  # the vocabulary sweep's concurrent calls to one engine


async def get_text(
    session: aiohttp.ClientSession, backend: Backend, path: str, timeout: float
) -> tuple[int, str]:
    """One GET of the engine with its own headers: (status, body text). Raises what aiohttp
    and the timeout raise (callers say what a silent engine means to them)."""
    async with session.get(
        backend.url + path,
        headers=backend.call_headers(os.environ),
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as resp:
        return resp.status, await resp.text()


UNANSWERED = (aiohttp.ClientError, TimeoutError, UnicodeDecodeError)


async def fetch_max_model_len(
    session: aiohttp.ClientSession, backend: Backend, timeout: float = 2.0
) -> int | None:
    """The engine's context length for the backend's model from its `GET /v1/models` (vLLM
    and SGLang say `max_model_len`); None when it does not say."""
    try:
        status, text = await get_text(session, backend, "/v1/models", timeout)
        body = orjson.loads(text) if status == 200 else None
    except (*UNANSWERED, orjson.JSONDecodeError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    models = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    mine = next((m for m in models if m.get("id") == backend.model), None)
    length = (mine or (models[0] if len(models) == 1 else {})).get("max_model_len")
    usable = isinstance(length, int) and not isinstance(length, bool) and length > 0
    return length if usable else None


async def fetch_metrics_page(
    session: aiohttp.ClientSession, backend: Backend, timeout: float
) -> str | None:
    """The engine's /metrics page; None when it does not answer with one."""
    try:
        status, text = await get_text(session, backend, "/metrics", timeout)
    except UNANSWERED:
        return None
    return text if status == 200 else None


class _Engine:
    """One backend's tokenizer and info endpoints, in its kind's dialect. Every answer that
    is not what the kind promises is a FactsError naming the backend and the endpoint."""

    def __init__(self, session: aiohttp.ClientSession, backend: Backend, within: float) -> None:
        self._session = session
        self.backend = backend
        self.kind = backend.kind
        self._limit = asyncio.Semaphore(CALLS_AT_ONCE)
        # One deadline for the whole read, not one per call: a busy engine may answer one
        # call slowly (a replica starting beside it on a small machine), and the operator's
        # --timeout says how long the whole bind may take.
        self._deadline = asyncio.get_running_loop().time() + within

    def _left(self) -> float:
        return max(0.001, self._deadline - asyncio.get_running_loop().time())

    def error(self, what: str) -> FactsError:
        return FactsError(f"facts: {self.backend.id} {what}")

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON or None)."""
        async with self._limit:
            try:
                async with self._session.request(
                    method,
                    self.backend.url + path,
                    data=None if body is None else orjson.dumps(body),
                    headers={**self.backend.call_headers(os.environ),
                             "Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=self._left()),
                ) as resp:
                    raw = await resp.read()
                    status = resp.status
            except UNANSWERED as exc:
                raise self.error(f"unreachable ({type(exc).__name__}) at {path}") from exc
        try:
            return status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return status, None

    async def ok(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        status, parsed = await self.call(method, path, body)
        if status != 200:
            raise self.error(f"answered {path} with {status}")
        if not isinstance(parsed, dict):
            raise self.error(f"sent no JSON object from {path}")
        return parsed

    async def text(self, path: str) -> str:
        """A GET whose answer is text (a /metrics page)."""
        try:
            status, text = await get_text(self._session, self.backend, path, self._left())
        except UNANSWERED as exc:
            raise self.error(f"unreachable ({type(exc).__name__}) at {path}") from exc
        if status != 200:
            raise self.error(f"answered {path} with {status}")
        return text

    async def tokenize(self, text: str) -> tuple[list[int], list[str] | None]:
        """The ids of `text` without the tokenizer's own BOS/EOS (special tokens written
        in the text are parsed as such, as every engine does by default)."""
        if self.kind is BackendKind.OPENAI:
            body = {"content": text, "add_special": False, "parse_special": True,
                    "with_pieces": True}  # fmt: skip
            got = (await self.ok("POST", "/tokenize", body)).get("tokens")
            if not isinstance(got, list) or not all(isinstance(t, dict) for t in got):
                raise self.error("sent /tokenize without tokens")
            ids, pieces = [t.get("id") for t in got], [t.get("piece") for t in got]
            # A piece that is not valid UTF-8 comes as its bytes: kept as their list.
            return _ids(self, ids), [p if isinstance(p, str) else repr(p) for p in pieces]
        body = {"model": self.backend.model, "prompt": text, "add_special_tokens": False}
        if self.kind is BackendKind.VLLM:
            body["return_token_strs"] = True
        answer = await self.ok("POST", "/tokenize", body)
        strs = answer.get("token_strs")
        return _ids(self, answer.get("tokens")), strs if isinstance(strs, list) else None

    async def detokenize(self, ids: list[int]) -> str | None:
        """The text of `ids`, special tokens spelled; None when the engine refuses them
        (an id past its vocabulary)."""
        body: dict[str, Any] = {"tokens": ids}
        if self.kind is not BackendKind.OPENAI:
            body["model"] = self.backend.model
        if self.kind is BackendKind.SGLANG:
            body["skip_special_tokens"] = False
        status, answer = await self.call("POST", "/detokenize", body)
        if status != 200:
            return None
        field = {BackendKind.OPENAI: "content", BackendKind.SGLANG: "text"}.get(self.kind, "prompt")
        text = answer.get(field) if isinstance(answer, dict) else None
        if not isinstance(text, str):
            raise self.error(f"sent /detokenize without '{field}'")
        return text

    async def spells(self, token: int) -> bool:
        """Whether `token` is in the tokenizer: an id past the end is refused, or (vLLM,
        whose tokenizer drops ids it does not know) spelled as nothing."""
        return bool(await self.detokenize([token]))


def _ids(engine: _Engine, v: Any) -> list[int]:
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    raise engine.error("sent token ids that are not a list of integers")


async def _vocab_size(engine: _Engine) -> int:
    if engine.kind is BackendKind.OPENAI:
        models = (await engine.ok("GET", "/v1/models")).get("data")
        meta = models[0].get("meta") if isinstance(models, list) and models else None
        n = meta.get("n_vocab") if isinstance(meta, dict) else None
        if not isinstance(n, int) or n <= 0:
            raise engine.error("sent /v1/models without meta.n_vocab")
        # Trusted as it is: the GGUF's vocabulary, padded to the model's rows with unused
        # tokens whose text is empty (so "spelled" cannot find its end).
        return n
    if not await engine.spells(0):
        raise engine.error("cannot spell token id 0")
    lo, hi = 0, 256  # lo is spelled; find an id that is not, then the first such
    while await engine.spells(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_VOCAB:
            raise engine.error(f"spells every id up to {lo}: no end of its vocabulary")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if await engine.spells(mid) else (lo, mid)
    return hi


async def _sweep(engine: _Engine) -> Sweep:
    sweep = Sweep(vocab_size=await _vocab_size(engine))
    newline, _ = await engine.tokenize("\n")
    if len(newline) != 1:
        raise engine.error(f"cuts a newline into {len(newline)} tokens")
    sweep.separator = newline[0]

    async def chunk(start: int) -> tuple[str, list[int]]:
        ids = chunk_with_separator(start, min(start + SWEEP_CHUNK, sweep.vocab_size),
                                   sweep.separator)  # fmt: skip
        text = await engine.detokenize(ids)
        if text is None:
            raise engine.error(f"refused to spell ids {start}.. below its vocab size")
        cut, _ = await engine.tokenize(text)
        return text, cut

    starts = range(0, sweep.vocab_size, SWEEP_CHUNK)
    sweep.chunks = list(await asyncio.gather(*(chunk(s) for s in starts)))
    sweep.probes = list(await asyncio.gather(*(engine.tokenize(t) for t in PROBE_CORPUS)))
    return sweep


async def _block_size(engine: _Engine) -> int | None:
    if engine.kind is BackendKind.OPENAI:
        return None  # llama.cpp keeps a contiguous cache per slot: no blocks
    if engine.kind is BackendKind.SGLANG:
        size = (await engine.ok("GET", "/get_server_info")).get("page_size")
        if not isinstance(size, int) or size <= 0:
            raise engine.error("sent /get_server_info without page_size")
        return size
    text = await engine.text("/metrics")
    try:
        return block_size_from_metrics(text)
    except FactsError as exc:
        raise engine.error(str(exc)) from exc


async def fetch_facts(session: aiohttp.ClientSession, backend: Backend, timeout: float) -> Facts:
    """The backend's facts, read within `timeout` seconds. Raises FactsError naming the
    backend when it can't say (no endpoint, down, junk, too slow)."""
    engine = _Engine(session, backend, timeout)
    try:
        return await asyncio.wait_for(_read(engine), timeout)
    except TimeoutError:
        raise engine.error(f"did not tell its facts within {timeout:g} s") from None


async def _read(engine: _Engine) -> Facts:
    sweep, block = await asyncio.gather(_sweep(engine), _block_size(engine))
    return Facts(sweep.fingerprint(), sweep.vocab_size, block, engine=engine.kind.value)
