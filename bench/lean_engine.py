"""`python -m bench.lean_engine`: the cheapest engine a router can be measured against.

It answers what vLLM 0.32 answers to the calls a router makes, as fast as it can: no model,
no tokenizer, every generated token the same text, and every answer's bytes encoded once per
shape and reused with only the request id put in. A whole answer costs it a third to a half
of what it costs the sim with its cost model zeroed, so what a router adds is not hidden
behind the engine (docs/benchmarks.md#overhead).

- `POST /v1/completions` and `/v1/chat/completions`, whole or streamed (one token per SSE
  event; the last token's event carries the finish reason; `stream_options.include_usage`
  adds the usage event; then `data: [DONE]`), `max_tokens` honoured (default 16), and with
  `"return_token_ids": true` vLLM's `token_ids` on each choice and `prompt_token_ids` (on the
  first chunk: the choice's for completions, the top level's for chat);
- `GET /health`, `GET /v1/models` (with `max_model_len`), and `GET /metrics` with vLLM's
  load gauges, which Baton's control reads.

A stream sends each event on its own and yields to the event loop between tokens, as an
engine's step loop would: concurrent streams interleave one token at a time, and a router
relays events that come apart, not a whole stream in one read (which is what makes a stream
cost it about what it costs the unpaced sim, which writes it at once).

Prints `ENGINE READY http://HOST:PORT` once bound (clients.procs.Part).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import os
import time
from dataclasses import dataclass
from typing import Any

import orjson
import uvloop
from aiohttp import web

TOKEN_TEXT = " x"
FIRST_TOKEN_ID = 1000  # generated token i has id FIRST_TOKEN_ID + i
BYTES_PER_PROMPT_TOKEN = 4  # a prompt of n bytes "has" n / 4 tokens, ids 1, 2, ...
DEFAULT_MAX_TOKENS = 16
MAX_MODEL_LEN = 4096
CREATED = int(time.time())
FINGERPRINT = "lean"
# Where each answer's request id goes: encoded answers are split here, the id joins them.
ID_MARK = "@@request-id@@"
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Shape:
    """Everything an answer's bytes depend on but its id: the key of the encoded answers."""

    model: str
    chat: bool
    prompt_tokens: int
    max_tokens: int
    return_token_ids: bool = False
    include_usage: bool = False


def _usage(shape: Shape) -> dict[str, int]:
    total = shape.prompt_tokens + shape.max_tokens
    return {"prompt_tokens": shape.prompt_tokens, "completion_tokens": shape.max_tokens,
            "total_tokens": total}  # fmt: skip


def _prompt_ids(shape: Shape) -> list[int]:
    return list(range(1, shape.prompt_tokens + 1))


def _head(shape: Shape, obj: str) -> dict[str, Any]:
    return {"id": ID_MARK, "object": obj, "created": CREATED, "model": shape.model}


def whole_answer(shape: Shape) -> dict[str, Any]:
    """The non-streamed answer, as vLLM writes it (`ID_MARK` for its id)."""
    text = TOKEN_TEXT * shape.max_tokens
    choice: dict[str, Any] = {"index": 0}
    if shape.chat:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason="length", stop_reason=None)
    if shape.return_token_ids:
        if not shape.chat:
            choice["prompt_token_ids"] = _prompt_ids(shape)
        choice["token_ids"] = [FIRST_TOKEN_ID + i for i in range(shape.max_tokens)]
    body = _head(shape, "chat.completion" if shape.chat else "text_completion")
    body.update(choices=[choice], usage=_usage(shape), system_fingerprint=FINGERPRINT)
    if shape.chat and shape.return_token_ids:
        body["prompt_token_ids"] = _prompt_ids(shape)
    return body


def stream_events(shape: Shape) -> list[dict[str, Any]]:
    """The streamed answer's events before `[DONE]`, as vLLM writes them: a chat stream opens
    with the role; one event per token; the finish reason on the last token's."""
    head = _head(shape, "chat.completion.chunk" if shape.chat else "text_completion")
    events: list[dict[str, Any]] = []
    if shape.chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip
        events.append({**head, "choices": [role]})
        if shape.return_token_ids:
            events[0]["prompt_token_ids"] = _prompt_ids(shape)
    last = shape.max_tokens - 1
    for i in range(shape.max_tokens):
        choice: dict[str, Any] = {"index": 0}
        if shape.chat:
            choice["delta"] = {"content": TOKEN_TEXT}
        else:
            choice["text"] = TOKEN_TEXT
        choice.update(logprobs=None, finish_reason="length" if i == last else None)
        if i == last:
            choice["stop_reason"] = None
        if shape.return_token_ids:
            if i == 0 and not shape.chat:
                choice["prompt_token_ids"] = _prompt_ids(shape)
            choice["token_ids"] = [FIRST_TOKEN_ID + i]
        event = {**head, "choices": [choice]}
        if i == last and not shape.include_usage:
            event["system_fingerprint"] = FINGERPRINT
        events.append(event)
    if shape.include_usage:
        events.append({**head, "choices": [], "usage": _usage(shape),
                       "system_fingerprint": FINGERPRINT})  # fmt: skip
    return events


def _split(encoded: bytes) -> list[bytes]:
    """`encoded` cut where the id goes: `rid.join(pieces)` is the answer for id `rid`."""
    return encoded.split(ID_MARK.encode())


@functools.lru_cache(maxsize=1024)
def encoded_whole(shape: Shape) -> list[bytes]:
    return _split(orjson.dumps(whole_answer(shape)))


@functools.lru_cache(maxsize=1024)
def encoded_stream(shape: Shape) -> list[list[bytes]]:
    return [_split(b"data: " + orjson.dumps(e) + b"\n\n") for e in stream_events(shape)]


class Refused(ValueError):
    """A request vLLM refuses too, with vLLM's status for it."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _first_set(body: dict[str, Any], *keys: str) -> Any:
    return next((body[k] for k in keys if body.get(k) is not None), None)


def shape_of(body: Any, model: str, chat: bool) -> tuple[Shape, bool]:
    """The answer's shape and whether it streams."""
    if not isinstance(body, dict):
        raise Refused("Request body must be a JSON object")
    asked = body.get("model")
    if asked is not None and asked != model:
        raise Refused(f"The model `{asked}` does not exist.", 404)
    max_tokens = _first_set(body, "max_completion_tokens", "max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if type(max_tokens) is not int or max_tokens < 1:
        raise Refused("max_tokens must be an integer of at least 1")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise Refused("'messages' is required")
        prompt_bytes = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    else:
        prompt_bytes = len(str(body.get("prompt", "")))
    stream = body.get("stream") is True
    options = body.get("stream_options")
    shape = Shape(
        model=model,
        chat=chat,
        prompt_tokens=max(1, prompt_bytes // BYTES_PER_PROMPT_TOKEN),
        max_tokens=max_tokens,
        return_token_ids=body.get("return_token_ids") is True,
        include_usage=stream and isinstance(options, dict) and options.get("include_usage") is True,
    )
    return shape, stream


def _refusal(e: Refused) -> web.Response:
    kind = "NotFoundError" if e.status == 404 else "BadRequestError"
    error = {"error": {"message": str(e), "type": kind, "param": None, "code": e.status}}
    return web.Response(status=e.status, body=orjson.dumps(error), content_type="application/json")


class Engine:
    def __init__(self, model: str) -> None:
        self.model = model
        self.running = 0  # requests being answered: vllm:num_requests_running
        # Unique across replicas, as vLLM's random ids are; a counter keeps it cheap.
        self._id_prefix = os.urandom(8).hex()
        self._ids = itertools.count()
        self._models = orjson.dumps({"object": "list", "data": [{
            "id": model, "object": "model", "created": CREATED, "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": MAX_MODEL_LEN, "permission": [],
        }]})  # fmt: skip

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", functools.partial(self.generate, chat=False))
        app.router.add_post("/v1/chat/completions", functools.partial(self.generate, chat=True))
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            shape, stream = shape_of(orjson.loads(await request.read()), self.model, chat)
        except orjson.JSONDecodeError as e:
            return _refusal(Refused(f"Invalid JSON body: {e}"))
        except Refused as e:
            return _refusal(e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self._id_prefix}{next(self._ids):016x}".encode()
        self.running += 1
        try:
            if not stream:
                return web.Response(body=rid.join(encoded_whole(shape)),
                                    content_type="application/json")  # fmt: skip
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in encoded_stream(shape):
                await resp.write(rid.join(event))
                await asyncio.sleep(0)  # one engine step: the other streams get their token
            await resp.write(DONE)
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(body=self._models, content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'{{model_name="{self.model}",engine="0"}}'
        text = (
            f"# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {self.running}.0\n"
            f"# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} 0.0\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} 0.0\n"
        )
        return web.Response(text=text, content_type="text/plain")


async def serve(host: str, port: int, model: str) -> None:
    runner = web.AppRunner(Engine(model).app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"ENGINE READY http://{host}:{bound}", flush=True)
    await asyncio.Event().wait()  # until SIGTERM ends the process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lean_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any free one)")
    p.add_argument("--model", default="toy")
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    uvloop.run(serve(host, int(port), args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
