"""The shim's connections to backends, seen from a backend that records which connection
(client port) each request came on: finished streams give their connection back to the pool,
a failover's resume goes out on a standby connection opened before the failure, and a backend
that never ends its response after [DONE] does not hold the client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.integration.harness import MODEL, http, start_sim, wait_until
from tests.integration.test_limits import custom_fleet

pytestmark = pytest.mark.timeout(90)

WORDS = ["alpha", " beta", " gamma", " delta", " epsilon", " zeta"]


class RecordingEngine:
    """An in-process OpenAI-compatible engine (text only) on 127.0.0.1:0 that records the
    method, path and client port of every request. `linger`: seconds it keeps a stream's
    response open after [DONE] before ending it."""

    def __init__(self, linger: float = 0.0) -> None:
        self.seen: list[tuple[str, str, int]] = []
        self.ended: list[float] = []  # when each lingering response was finally ended
        self._linger = linger
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10), "engine did not start"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/health", _ok)
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/completions", self._complete)
        # handler_cancellation: a closed connection ends a lingering response at once.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        ready.set()
        self._loop.run_forever()

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        with self._lock:
            self.seen.append((request.method, request.path, peer[1] if peer else 0))
        return await handler(request)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(_whole(body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, word in enumerate(WORDS):
            last = i == len(WORDS) - 1
            chunk = {"id": "cmpl-r", "object": "text_completion", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "text": word,
                                  "finish_reason": "length" if last else None}]}  # fmt: skip
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        if self._linger:
            try:
                await asyncio.sleep(self._linger)
            finally:
                with self._lock:
                    self.ended.append(time.monotonic())
        return resp

    def requests(self, method: str, path: str) -> list[int]:
        """Client ports of the requests seen so far with this method and path."""
        with self._lock:
            return [port for m, p, port in self.seen if (m, p) == (method, path)]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def _whole(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "cmpl-r", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": "".join(WORDS), "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(WORDS),
                      "total_tokens": 1 + len(WORDS)}}  # fmt: skip


@pytest.fixture
def engine() -> Iterator[RecordingEngine]:
    e = RecordingEngine()
    yield e
    e.close()


def stream(base: str, prompt: str = "hello") -> str:
    """One streaming completion through the shim; the text the client got."""
    status, raw = http(
        "POST",
        base + "/v1/completions",
        json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": len(WORDS),
                    "stream": True}).encode(),  # fmt: skip
        {"Content-Type": "application/json"},
    )
    assert status == 200, raw
    lines = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", raw
    return "".join(
        c["choices"][0].get("text", "")
        for c in map(json.loads, lines[:-1])
        if c.get("choices")
    )


def test_finished_streams_give_their_connection_back(
    tmp_path: Path, engine: RecordingEngine
) -> None:
    with custom_fleet(tmp_path, [("r", engine.url)], kind="openai") as (_, shim):
        for _ in range(6):
            assert stream(shim.ready) == "".join(WORDS)
    ports = engine.requests("POST", "/v1/completions")
    assert len(ports) == 6
    # One connection carries them all (a race with the last stream's trailer may open a second);
    # closing each stream's connection would have used six.
    assert len(set(ports)) <= 2, ports


@pytest.mark.parametrize("spare", [4, 0])
def test_a_resume_goes_out_on_a_connection_opened_before_the_failure(
    tmp_path: Path, engine: RecordingEngine, spare: int
) -> None:
    # The sim dies after 2 chunks of every stream; the engine is where those resume.
    dying = start_sim("--fault", "die-after=2")
    backends = [("dying", dying.ready), ("r", engine.url)]
    try:
        with custom_fleet(tmp_path, backends, "--standby-connections", str(spare),
                          kind="openai") as (_, shim):  # fmt: skip
            if spare:
                # The standby pool has opened its connections (GETs on the probe path of kind
                # openai from `spare` client ports; control's own probes come one at a time).
                assert wait_until(
                    lambda: len(set(engine.requests("GET", "/v1/models"))) >= spare
                )
            resumed = None
            for i in range(12):  # routing alternates; bounded until one lands on the sim
                before = set(engine.requests("GET", "/v1/models"))
                posts = len(engine.requests("POST", "/v1/completions"))
                text = stream(shim.ready, f"prompt {i}")
                new = engine.requests("POST", "/v1/completions")[posts:]
                if text != "".join(WORDS):  # started on the sim: resumed on the engine
                    resumed = (before, new[0])
                    break
            assert resumed is not None, "no stream landed on the dying sim"
            warm, port = resumed
            if spare:
                assert port in warm, (port, warm)
            else:
                assert port not in warm, (port, warm)
    finally:
        dying.stop()


def test_a_backend_that_never_ends_its_response_does_not_hold_the_client(
    tmp_path: Path,
) -> None:
    # The engine holds its response open 30 s after [DONE]. Idle, the client's answer takes
    # ~0.1 s and the shim ends the engine's side ~0.25 s (its trailer wait) after [DONE]:
    # the 5 s bounds below are >10x that, and far below the 30 s a client or a connection
    # held for the linger would show.
    engine = RecordingEngine(linger=30.0)
    try:
        with custom_fleet(tmp_path, [("r", engine.url)], kind="openai") as (_, shim):
            start = time.monotonic()
            assert stream(shim.ready) == "".join(WORDS)
            took = time.monotonic() - start
            # The client's answer ended with [DONE], not with the engine's response; the shim
            # gave up on the trailer and closed that connection, which ends the engine's side.
            assert took < 5.0, took
            assert wait_until(lambda: bool(engine.ended), timeout=10.0)
            assert engine.ended[0] - start < 5.0, engine.ended[0] - start
    finally:
        engine.close()
