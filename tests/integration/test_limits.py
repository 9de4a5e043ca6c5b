"""The shim's data-plane limits and API keys, against real processes (control, shim, sims):
each limit answers with its OpenAI-shaped error and status, and the shim keeps serving."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from tests.integration.harness import (
    MODEL,
    fleet,
    http_full,
    metric,
    start_control,
    start_shim,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.timeout(90)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def post(
    base: str,
    body: object,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, Any], dict[str, str]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, data, hdrs = http_full(
        "POST", base + path, raw, {"Content-Type": "application/json", **(headers or {})}
    )
    return status, json.loads(data), hdrs


def assert_openai_error(body: dict[str, Any], code: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"]


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


class FakeBackend:
    """An in-process OpenAI-ish engine on 127.0.0.1:0 in its own thread, for what a sim
    cannot show: the headers a backend receives, or streams of any shape (`stream` maps a
    request number to the bytes to send; the connection closes after them)."""

    def __init__(self, stream: Callable[[int, dict[str, Any]], list[bytes]] | None = None) -> None:
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self._stream = stream
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "fake backend did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", _ok)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.requests)
        self.requests.append((dict(request.headers), body))
        if self._stream is not None and body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for piece in self._stream(n, body):
                await resp.write(piece)
            # Closing the transport without the chunked terminator: whatever the script sent
            # is all the shim gets.
            if request.transport is not None:
                request.transport.close()
            return resp
        chat = request.path.endswith("chat/completions")
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": "ok"}
        else:
            choice["text"] = "ok"
        return web.json_response(
            {"id": "x", "object": "chat.completion" if chat else "text_completion",
             "created": 0, "model": body.get("model"), "choices": [choice],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        )  # fmt: skip

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextmanager
def custom_fleet(
    tmp_path: Path, backends: list[tuple[str, str]], *shim_args: str,
    shim_env: dict[str, str] | None = None, probe_interval: float = 0.2, control_extra: str = "",
    kind: str = "vllm",
) -> Iterator[tuple[Any, Any]]:  # fmt: skip
    """Control over the given backend URLs (all of `kind`) and one shim: (control, shim)."""
    config = write_config(
        tmp_path / "control.toml", backends, probe_interval=probe_interval, extra=control_extra,
        kind=kind,
    )  # fmt: skip
    control = start_control(config)
    try:
        shim = start_shim(control.ready, *shim_args, env=shim_env)
        try:
            yield control, shim
        finally:
            shim.stop(grace=3)
    finally:
        control.stop(grace=3)


# -- body, headers, messages ------------------------------------------------------------------


def test_body_header_and_message_limits_answer_in_openai_shape(tmp_path: Path) -> None:
    args = ("--max-body-bytes", "4096", "--max-header-bytes", "2048", "--max-messages", "3")
    with fleet(tmp_path, n=1, shim_args=args) as f:
        base = f.shim.ready

        # Body: a declared Content-Length over the limit is refused before reading it...
        padded = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        status, body, _ = post(base, padded)
        assert status == 413
        assert_openai_error(body, "request_too_large")
        # ...and so is a chunked body with no length, once it passes the limit.
        conn = http.client.HTTPConnection(urllib.parse.urlsplit(base).netloc, timeout=10)
        raw = json.dumps(padded).encode()
        conn.request(
            "POST", "/v1/chat/completions", body=iter([raw[:3000], raw[3000:]]),
            headers={"Content-Type": "application/json"}, encode_chunked=True,
        )  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 413
        assert_openai_error(json.loads(resp.read()), "request_too_large")
        conn.close()

        # Headers: over our limit → JSON 431; one line past even aiohttp's parser limit
        # → its own clean 400 (never a crash or a hang).
        status, body, _ = post(base, CHAT, {"X-Pad": "p" * 3000})
        assert status == 431
        assert_openai_error(body, "request_header_fields_too_large")
        status, data, _ = http_full("POST", base + "/v1/chat/completions",
                                    json.dumps(CHAT).encode(), {"X-Pad": "p" * 20_000})  # fmt: skip
        assert status == 400 and data

        # Messages: 3 allowed, 4 refused with param "messages".
        three = {**CHAT, "messages": [{"role": "user", "content": "a"}] * 3}
        assert post(base, three)[0] == 200
        status, body, _ = post(base, {**three, "messages": three["messages"] * 2})
        assert status == 400
        assert_openai_error(body, "invalid_request_error")
        assert body["error"]["param"] == "messages" and "limit is 3" in body["error"]["message"]

        # Still serving, and the SDK maps the statuses to its exceptions.
        c = openai.OpenAI(base_url=f.base_url, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}] * 4)
        assert err.value.status_code == 400
        assert c.chat.completions.create(**CHAT).choices[0].message.content  # type: ignore[call-overload]
        assert f.shim.alive


def test_an_over_long_model_name_gets_a_400_that_does_not_echo_it(tmp_path: Path) -> None:
    """A 5 MB `model` is refused at the edge (OpenAI's shape; Anthropic's on /v1/messages),
    its error does not carry the name back, and control is never asked about it."""
    name = "m" * (5 * 1024 * 1024)
    with fleet(tmp_path, n=1) as f:
        base = f.shim.ready
        status, body, _ = post(base, {**CHAT, "model": name})
        assert status == 400
        assert_openai_error(body, "invalid_request_error")
        assert body["error"]["param"] == "model" and len(body["error"]["message"]) < 200
        messages = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        status, body, _ = post(base, messages, path="/v1/messages")
        assert status == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert len(body["error"]["message"]) < 200
        # Neither reached control's route question; a real name still does.
        assert metric(base, "baton_shim_route_seconds_count") == 0
        assert post(base, CHAT)[0] == 200
        assert metric(base, "baton_shim_route_seconds_count") == 1


# -- concurrent streams -------------------------------------------------------------------------


def open_stream(base: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(base).netloc, timeout=30)
    body = {**CHAT, "stream": True, "max_tokens": 400}
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # it is streaming now
    return conn, resp


def test_requests_past_the_in_flight_cap_get_429_before_their_body_is_read(
    tmp_path: Path,
) -> None:
    # Slow decoding, so the open streams stay open while the test looks.
    slow = [("--decode-ms-per-step", "50")]
    with fleet(tmp_path, n=1, per_sim=slow, shim_args=("--max-streams", "2")) as f:
        base = f.shim.ready
        streams = [open_stream(base), open_stream(base)]
        status, body, headers = post(base, {**CHAT, "stream": True})
        assert status == 429 and headers.get("Retry-After") == "1"
        assert_openai_error(body, "too_many_concurrent_streams")
        assert body["error"]["type"] == "rate_limit_error"
        # The SDK sees its RateLimitError; a request that does not stream holds an engine
        # slot as well, so it counts too.
        c = openai.OpenAI(base_url=f.base_url, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError):
            c.chat.completions.create(**CHAT, stream=True)  # type: ignore[call-overload]
        assert post(base, CHAT)[0] == 429
        # Shed before the body is parsed: a body that is not even JSON gets the 429, not the
        # 400 it would get once read. Calls that generate nothing are not held back.
        status, _, _ = http_full("POST", base + "/v1/chat/completions", b"{not json")
        assert status == 429
        assert http_full("GET", base + "/v1/models")[0] == 200
        assert http_full("GET", base + "/health/ready")[1].startswith(b"not ready: at its")

        # A client that goes away gives its slot back.
        conn, resp = streams.pop()
        resp.close()
        conn.close()
        again = json.dumps({**CHAT, "stream": True}).encode()
        assert wait_until(
            lambda: http_full("POST", base + "/v1/chat/completions", again)[0] == 200, timeout=10
        )
        for conn, resp in streams:
            resp.close()
            conn.close()


# -- API keys -----------------------------------------------------------------------------------


def test_api_keys_from_a_file_are_required_and_never_forwarded(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team A\nsk-alpha\n\nsk-beta  # team B\n")
    backend = FakeBackend()
    try:
        with custom_fleet(tmp_path, [("fake", backend.url)], "--api-keys-file", str(keys)) as (
            _,
            shim,
        ):
            base = shim.ready
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-alpha"},
                            {"Authorization": "Basic sk-alpha"}):  # fmt: skip
                status, body, _ = post(base, CHAT, headers)
                assert status == 401, headers
                assert_openai_error(body, "invalid_api_key")
                assert "sk-" not in body["error"]["message"]
            status, data, _ = http_full("GET", base + "/v1/models")
            assert status == 401
            # Probes and scrapes need no key.
            assert http_full("GET", base + "/health")[0] == 200
            assert http_full("GET", base + "/metrics")[0] == 200
            assert not backend.requests, "a refused request must not reach a backend"

            for key in ("sk-alpha", "sk-beta"):
                c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)
                reply = c.chat.completions.create(**CHAT)  # type: ignore[call-overload]
                assert reply.choices[0].message.content == "ok"
                assert [m.id for m in c.models.list().data] == [MODEL]
            bad = openai.OpenAI(base_url=base + "/v1", api_key="sk-nope", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    finally:
        backend.close()
    # The engine saw neither key: the client's Authorization stops at the shim.
    assert len(backend.requests) == 2
    for headers, _ in backend.requests:
        assert "Authorization" not in headers and "authorization" not in headers
        assert not any("sk-" in v for v in headers.values())


def test_api_keys_from_the_environment(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1, shim_env={"BATON_API_KEYS": "k1, k2"}) as f:
        base = f.shim.ready
        assert post(base, CHAT)[0] == 401
        assert post(base, CHAT, {"Authorization": "Bearer k2"})[0] == 200
        assert post(base, CHAT, {"Authorization": "bearer k1"})[0] == 200


def test_an_empty_keys_file_refuses_to_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    keys = tmp_path / "keys"
    keys.write_text("# nobody yet\n")
    out = subprocess.run(
        [sys.executable, "-m", "dataplane", "--control", "127.0.0.1:1",
         "--listen", "127.0.0.1:0", "--api-keys-file", str(keys)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode != 0 and "holds no API keys" in out.stderr


def test_the_backend_gets_its_own_key_never_the_clients(tmp_path: Path) -> None:
    """A vLLM-style engine with --api-key: the shim authenticates the client with the client's
    key and the engine with the engine's (named by api_key_env, read from the environment)."""
    from tests.integration.harness import start_control, start_shim, start_sim, write_config

    sim = start_sim("--api-key", "engine-secret")
    parts = [sim]
    try:
        config = write_config(tmp_path / "control.toml", [("s0", sim.ready)])
        config.write_text(config.read_text().replace('kind = "vllm"',
                                                     'kind = "vllm"\napi_key_env = "S0_KEY"'))
        env = {"S0_KEY": "engine-secret"}
        control = start_control(config, env=env)
        parts.append(control)
        shim = start_shim(control.ready, env={**env, "BATON_API_KEYS": "client-key"})
        parts.append(shim)
        base = shim.ready
        assert post(base, CHAT, {"Authorization": "Bearer client-key"})[0] == 200
        # The engine really checks: the client's key (or none) is refused there.
        assert post(sim.ready, CHAT, {"Authorization": "Bearer client-key"})[0] == 401
        assert post(sim.ready, CHAT)[0] == 401
    finally:
        for p in reversed(parts):
            p.stop(grace=3)
