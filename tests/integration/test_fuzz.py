"""Hostile input through real processes (control, shim, sims, and an in-test engine that
speaks garbage): thousands of malformed requests, and streams from backends that send junk.
Every answer must be a well-formed OpenAI error or a correct success, every stream must end
in [DONE] after complete content or in an error event (never cut short), and every process
must still be alive and serving at the end. Bounded in count and in time; seeded."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.harness import MODEL, fleet, http, start_sim
from tests.integration.test_limits import FakeBackend, custom_fleet

pytestmark = pytest.mark.timeout(240)

# Malformed (and some valid) requests: all of them are sent, or the test fails. A smaller
# run is only by choice, and says so: BATON_FUZZ_REQUESTS=N (printed with the seed).
REQUESTS = int(os.environ.get("BATON_FUZZ_REQUESTS") or 3000)
SEED = int(os.environ.get("BATON_FUZZ_SEED") or 7)
GARBAGE_STREAMS = 600
TIME_CAP = 90.0  # seconds per phase: a guard against a hang, never a reason to stop early
CONCURRENCY = 8

Check = Callable[[int, bytes, bool], str]


# -- what a client must be able to rely on ----------------------------------------------------


def check_error(status: int, body: bytes) -> str:
    assert 400 <= status < 500, (status, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    # Engines' own 4xx are relayed as they are: vLLM's `code` is the status as an integer.
    assert isinstance(err["type"], str) and isinstance(err["code"], str | int | None)
    return f"{status} {err['code']}"


def check_stream(body: bytes) -> str:
    """'complete' or 'error-event'; fails on anything else (a cut or malformed stream)."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-300:]
    events = [e for e in body.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events), body[:300]
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert objs, "a stream with no content before [DONE]"
    if "error" in objs[-1]:
        err = objs[-1]["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return "error-event"
    finished: dict[int, bool] = {}
    for obj in objs:
        assert "error" not in obj, obj
        for ch in obj.get("choices", []):
            finished[ch["index"]] = finished.get(ch["index"], False) or bool(ch["finish_reason"])
    assert finished and all(finished.values()), f"unfinished choices: {finished}"
    return "complete"


def check_answer(status: int, body: bytes, stream: bool) -> str:
    if status != 200:
        return check_error(status, body)
    if stream:
        return "stream " + check_stream(body)
    reply = json.loads(body)
    assert reply["choices"] and all(c["finish_reason"] for c in reply["choices"]), reply
    return "200 whole"


async def drive(
    base: str, requests: list[tuple[str, str, bytes, dict[str, str]]], check: Check
) -> dict[str, int]:
    """Send all of them, CONCURRENCY at a time; tally each answer's kind. Fails if they are
    not all answered within TIME_CAP."""
    tally: dict[str, int] = {}
    queue = list(reversed(requests))
    deadline = time.monotonic() + TIME_CAP
    timeout = aiohttp.ClientTimeout(total=30)

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            if time.monotonic() > deadline:
                done = sum(tally.values())
                raise AssertionError(f"only {done} of {len(requests)} answered in {TIME_CAP}s")
            method, path, body, headers = queue.pop()
            async with session.request(method, base + path, data=body, headers=headers) as r:
                data = await r.read()
                stream = r.headers.get("Content-Type", "").startswith("text/event-stream")
                try:
                    kind = check(r.status, data, stream)
                except (AssertionError, ValueError, KeyError, TypeError) as exc:
                    raise AssertionError(f"{method} {path} {body[:200]!r} -> {exc}") from exc
            tally[kind] = tally.get(kind, 0) + 1

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    return tally


# -- malformed requests -------------------------------------------------------------------------


def any_json(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 3 else 6)
    if pick == 6:
        return [any_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 7:
        keys = ["role", "content", "type", "text", "x"]
        return {rng.choice(keys): any_json(rng, depth + 1) for _ in range(rng.randrange(4))}
    if pick == 8:
        return [{"role": "user", "content": any_json(rng, depth + 1)}]
    return [
        None, rng.choice([True, False]), rng.randint(-(2**63), 2**63 - 1), rng.uniform(-1e9, 1e9),
        "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(8))),
        rng.choice(["", "user", "assistant", "text", MODEL, "[DONE]", "\u0000"]),
    ][pick]  # fmt: skip


def valid(rng: random.Random) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.6
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(1, 8), "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello " * rng.randint(1, 4)}]
    else:
        body["prompt"] = rng.choice(["once", [1, 2, 3]])
    if rng.random() < 0.5:
        body["stream"] = True
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


FIELDS = ["model", "messages", "prompt", "max_tokens", "n", "stream", "stop", "temperature",
          "top_p", "seed", "stream_options", "best_of", "min_tokens", "max_completion_tokens",
          "logprobs", "response_format", "tools", "continue_final_message"]  # fmt: skip


def malformed(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    path, body = valid(rng)
    headers = {"Content-Type": "application/json"}
    kind = rng.randrange(10)
    if kind == 0:  # bytes
        raw = rng.randbytes(rng.randrange(300))
    elif kind == 1:  # cut JSON
        full = json.dumps(body).encode()
        raw = full[: rng.randrange(len(full))]
    elif kind == 2:  # any JSON at all
        raw = json.dumps(any_json(rng)).encode()
    elif kind in (3, 4, 5):  # a valid body with fields swapped for anything
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS)] = any_json(rng)
        raw = json.dumps(body).encode()
    elif kind == 6:  # a message or part of the wrong shape
        body.setdefault("messages", [{"role": "user", "content": "x"}])
        body["messages"].append(rng.choice([
            {"role": "user", "content": [{"type": "text", "text": any_json(rng)}]},
            {"role": any_json(rng), "content": "x"}, {"content": "x"}, any_json(rng),
            {"role": "assistant", "content": None, "tool_calls": any_json(rng)},
        ]))  # fmt: skip
        raw = json.dumps(body).encode()
        path = "/v1/chat/completions"
    elif kind == 7:  # JSON too deep, lone surrogates, NaN, duplicate keys
        raw = rng.choice([b"[" * 5000 + b"]" * 5000, b'{"model": "\\ud800"}', b'{"a": NaN}',
                          b'{"model": "toy", "model": 3, "prompt": "x"}'])  # fmt: skip
    elif kind == 8:  # valid: the fuzz must not reject good requests
        raw = json.dumps(body).encode()
    else:  # wrong route, method or content type
        raw = json.dumps(body).encode()
        path, method = rng.choice([
            ("/v1/chat/completion", "POST"), ("/v1/completions", "GET"), ("/v1/models", "POST"),
            ("/v1/chat/completions", "PUT"), ("/v2/x", "POST"), ("/v1/%00", "POST"),
        ])  # fmt: skip
        headers = {"Content-Type": rng.choice(["text/plain", "application/x-www-form-urlencoded"])}
        return method, path, raw, headers
    return "POST", path, raw, headers


def test_thousands_of_malformed_requests_get_openai_errors(tmp_path: Path) -> None:
    print(f"fuzz: seed {SEED}, {REQUESTS} requests (BATON_FUZZ_SEED, BATON_FUZZ_REQUESTS)")
    rng = random.Random(SEED)
    requests = [malformed(rng) for _ in range(REQUESTS)]
    shim_args = ("--max-body-bytes", "65536", "--max-messages", "64")
    with fleet(tmp_path, n=1, shim_args=shim_args) as f:
        started = time.monotonic()
        tally = asyncio.run(drive(f.shim.ready, requests, check_answer))
        took = time.monotonic() - started
        sent = sum(tally.values())
        print(f"fuzz: {sent} requests in {took:.1f}s: {dict(sorted(tally.items()))}")
        assert sent == REQUESTS, f"{sent} of {REQUESTS} answered"
        # Both kinds of answer happened: bad input was refused, good input served.
        assert sum(n for k, n in tally.items() if k.startswith("4")) > sent // 3
        assert tally.get("200 whole", 0) and tally.get("stream complete", 0)
        assert_all_serving(f.parts, f.shim.ready)


def assert_all_serving(parts: list[Any], shim: str) -> None:
    for part in parts:
        assert part.alive, f"{part.name} died"
    status, body = http("POST", shim + "/v1/completions",
                        json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3}).encode(),
                        {"Content-Type": "application/json"})  # fmt: skip
    assert status == 200 and json.loads(body)["choices"][0]["text"]


# -- garbage backend streams ----------------------------------------------------------------


def chunk(chat: bool, text: str, finish: str | None = None, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    obj = {"id": "fake", "object": "chat.completion.chunk" if chat else "text_completion",
           "created": 1, "model": MODEL, "choices": [choice], **extra}  # fmt: skip
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def script(n: int, body: dict[str, Any]) -> list[bytes]:
    """Garbage of one kind per request, in turn; the connection closes after it."""
    chat = "messages" in body
    ok = chunk(chat, "fine ")
    junk: list[list[bytes]] = [
        [random.Random(n).randbytes(200)],
        [b'data: {"choices": 5}\n\n'],
        [b'data: {"choices": [{"index": 7, "delta": {"content": "x"}, "text": "x"}]}\n\n'],
        [b'data: {"choices": [{"index": 0, "delta": {"content": 3}, "text": 3}]}\n\n'],
        [ok],  # cut: no finish, no [DONE]
        [ok, b"data: {broken\n\n"],
        [ok, b'data: {"error": {"message": "engine dead", "code": 500}}\n\n'],
        [ok, b"data: [DONE]\n\n"],  # [DONE] before the choice finished
        [b'data: {"prompt_token_ids": "abc", "choices": []}\n\n'],
        [ok, b'data: {"choices": [], "usage": {"prompt_tokens": "x"}}\n\n'],
        [b"data: " + b"x" * 65536 * 3, b"x" * 65536],  # no end in sight (cut while growing)
        [ok, b"\r\n: comment\r\n\r\n", b"data: [[[\r\r\n\n"],
        # A well-formed answer, with CRLF line endings: must pass straight through.
        [ok.replace(b"\n", b"\r\n"), chunk(chat, "done", "stop"), b"data: [DONE]\n\n"],
    ]
    return junk[n % len(junk)]


def stream_request(rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    path, body = valid(rng)
    # Above the one token the garbage sends first: a stream whose whole budget was sent
    # before the failure is resumed with max_tokens 0 (see the report), not what this tests.
    body.update(stream=True, max_tokens=rng.randint(3, 8))
    if rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"}


def test_garbage_backend_streams_end_complete_or_in_an_error_event(tmp_path: Path) -> None:
    rng = random.Random(11)
    requests = [stream_request(rng) for _ in range(GARBAGE_STREAMS)]
    fake = FakeBackend(stream=script)
    sims = [start_sim("--fault", "garbage"), start_sim()]
    try:
        backends = [("fake", fake.url), ("junk-sim", sims[0].ready), ("good-sim", sims[1].ready)]
        shim_args = ("--first-token-timeout", "5", "--inter-token-timeout", "5")
        # Round robin, and a demoted backend back after one good probe: the garbage engine
        # keeps getting requests instead of sitting out the run.
        extra = 'routing = "roundrobin"\n[health]\nreadmit_after = 1\n'
        with custom_fleet(
            tmp_path, backends, *shim_args, probe_interval=0.05, control_extra=extra
        ) as (control, shim):
            tally: dict[str, int] = {}
            deadline = time.monotonic() + TIME_CAP
            # In rounds until every garbage script ran twice (bounded by count and time).
            while requests and time.monotonic() < deadline and len(fake.requests) < 26:
                batch, requests = requests[:24], requests[24:]
                for kind, n in asyncio.run(drive(shim.ready, batch, check_answer)).items():
                    tally[kind] = tally.get(kind, 0) + n
            sent = sum(tally.values())
            print(f"garbage streams: {sent}: {dict(sorted(tally.items()))}")
            # The fake engine's garbage was met (every kind, twice), and failover to the good
            # sim turned most of it into complete streams.
            assert len(fake.requests) >= 26, f"{len(fake.requests)} garbage streams in {sent}"
            assert tally.get("stream complete", 0) > sent // 2
            assert_all_serving([control, shim, *sims], shim.ready)
    finally:
        for sim in sims:
            sim.stop(grace=3)
        fake.close()
