"""`python -m bench.loadgen`: a closed-loop load of N workers against one OpenAI base URL.

Runs in its own process so the benchmark can pin it next to the engine and account its CPU
apart from the orchestrator's. Prints one JSON object on stdout: raw latencies of the requests
started in the measurement window, completions inside it (and, for streams, the SSE events
they carried), every error (warm-up included, so none is silently dropped) and the CPU seconds
the given processes (or process trees) used during the window.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.cpu import cpu_seconds, tree_cpu_seconds

HEADERS = {"Content-Type": "application/json"}
DONE = b"data: [DONE]"
ERROR_EVENT = b'{"error"'  # an error event inside a 200 stream is still a failed request


@dataclass(frozen=True, slots=True)
class Outcome:
    start: float
    end: float
    first: float | None  # perf_counter at the first chunk holding a `data:` event (streams)
    events: int  # `data:` events received (streams; [DONE] counts as one)
    error: str | None


@dataclass(slots=True)
class Window:
    """Opened and closed by the sampler at the instants it reads CPU counters, so the request
    counts and the CPU seconds cover exactly the same interval."""

    start: float | None = None
    end: float | None = None
    cpu_start: dict[str, float] = field(default_factory=dict)
    cpu_end: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Watched:
    """The processes whose CPU is read, by name: `pids` alone, `trees` with all under them."""

    pids: Mapping[str, int] = field(default_factory=dict)
    trees: Mapping[str, int] = field(default_factory=dict)


def _sample(watched: Watched) -> dict[str, float]:
    # Blocking reads, but of a few hundred bytes from procfs each, twice a run.
    sample = {name: cpu_seconds(pid) for name, pid in watched.pids.items()}
    sample |= {name: tree_cpu_seconds(pid) for name, pid in watched.trees.items()}
    sample["loadgen"] = time.process_time()
    return sample


@dataclass(frozen=True, slots=True)
class Shape:
    """What a good answer looks like on the endpoint under load."""

    whole: bytes  # a field every whole answer carries
    end: bytes  # how a complete stream ends
    failed: tuple[bytes, ...]  # markers of a stream that ended in an error

    def ended(self, tail: bytes, seen_end: bool) -> bool:
        return seen_end if self.end != DONE else tail.rstrip().endswith(DONE)


SHAPES = {
    "completions": Shape(b'"choices"', DONE, (ERROR_EVENT,)),
    "chat": Shape(b'"choices"', DONE, (ERROR_EVENT,)),
    # A Responses stream has no [DONE]: it ends with its one response.completed event.
    "responses": Shape(b'"output"', b"event: response.completed",
                       (b"event: response.failed", b"event: error")),
    # Anthropic's Messages stream: no [DONE] either, it ends with message_stop.
    "messages": Shape(b'"content"', b"event: message_stop", (b"event: error",)),
}  # fmt: skip


async def _request(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, shape: Shape
) -> tuple[float | None, int, str | None]:
    """(when the first event came, how many events came, what went wrong)."""
    try:
        async with session.post(url, data=body, headers=HEADERS) as resp:
            if resp.status != 200:
                await resp.read()
                return None, 0, f"status {resp.status}"
            if not stream:
                data = await resp.read()
                return None, 0, None if shape.whole in data else "not an answer"
            first: float | None = None
            tail = b""
            events = 0
            failed = seen_end = False
            async for chunk in resp.content.iter_any():
                # `tail` joins a `data:` or an end marker split across two reads; the events
                # wholly inside it were counted with the read before.
                joined = tail + chunk
                events += joined.count(b"data:") - tail.count(b"data:")
                if first is None and events:
                    first = time.perf_counter()
                failed = failed or any(m in joined for m in shape.failed)
                seen_end = seen_end or shape.end in joined
                tail = joined[-32:]
            if failed:
                return first, events, "error event"
            return first, events, None if shape.ended(tail, seen_end) else "stream not ended"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return None, 0, type(exc).__name__


async def _worker(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    stream: bool,
    window: Window,
    out: list[Outcome],
) -> None:
    shape = SHAPES[_endpoint_of(url)]
    while window.end is None:
        start = time.perf_counter()
        first, events, error = await _request(session, url, body, stream, shape)
        out.append(Outcome(start, time.perf_counter(), first, events, error))


PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
         "responses": "/v1/responses", "messages": "/v1/messages"}  # fmt: skip


def _endpoint_of(url: str) -> str:
    return next(name for name, path in PATHS.items() if url.endswith(path))


def request_body(
    endpoint: str, model: str, prompt: str, max_tokens: int, stream: bool, store: bool
) -> bytes:
    """The one request every worker sends: greedy, `max_tokens` long."""
    if endpoint == "responses":
        return orjson.dumps({"model": model, "input": prompt, "max_output_tokens": max_tokens,
                             "temperature": 0, "stream": stream, "store": store})  # fmt: skip
    body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                               "stream": stream}  # fmt: skip
    if endpoint in ("chat", "messages"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return orjson.dumps(body)


async def _sampler(watched: Watched, warmup: float, duration: float, w: Window) -> None:
    await asyncio.sleep(warmup)
    w.cpu_start, w.start = _sample(watched), time.perf_counter()
    await asyncio.sleep(duration)
    w.cpu_end, w.end = _sample(watched), time.perf_counter()


async def run_load(
    url: str,
    body: bytes,
    *,
    stream: bool,
    concurrency: int,
    warmup: float,
    duration: float,
    watched: Watched,
) -> dict[str, object]:
    window = Window()
    outcomes: list[Outcome] = []
    # One session, one pooled keep-alive connection per worker: connection setup happens in
    # the warm-up and never inside the window.
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=60, sock_connect=5)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_sampler(watched, warmup, duration, window))
            for _ in range(concurrency):
                tg.create_task(_worker(session, url, body, stream, window, outcomes))
    return _report(window, outcomes, stream)


def _report(w: Window, outcomes: list[Outcome], stream: bool) -> dict[str, object]:
    assert w.start is not None and w.end is not None  # noqa: S101 - set before workers exit
    ok = [o for o in outcomes if o.error is None]
    measured = [o for o in ok if o.start >= w.start]
    ended_in_window = [o for o in ok if w.start <= o.end <= w.end]
    errors = Counter(o.error for o in outcomes if o.error is not None)
    return {
        "window_s": w.end - w.start,
        "ok_in_window": len(ended_in_window),
        # The events of the streams counted above, beside them: CPU per event is over these.
        "events_in_window": sum(o.events for o in ended_in_window),
        "latency_ms": [round((o.end - o.start) * 1e3, 4) for o in measured],
        # Non-streaming: the whole body is the first token, so TTFT is the latency.
        "ttft_ms": [
            round(((o.first if stream and o.first is not None else o.end) - o.start) * 1e3, 4)
            for o in measured
        ],
        "errors": sum(errors.values()),
        "errors_in_window": sum(1 for o in outcomes if o.error and o.start >= w.start),
        "error_kinds": dict(errors),
        "cpu_s": {k: w.cpu_end[k] - w.cpu_start[k] for k in w.cpu_end},
        "requests_total": len(outcomes),
    }


def _run(coro: Coroutine[object, object, dict[str, object]]) -> dict[str, object]:
    """uvloop when installed: the load generator must not be the slowest part of the loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _pid_arg(text: str) -> tuple[str, int]:
    name, _, pid = text.partition("=")
    return name, int(pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen")
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--endpoint", choices=sorted(PATHS), default="completions")
    parser.add_argument("--store", action="store_true", help="responses: store: true")
    parser.add_argument("--model", default="toy")
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    parser.add_argument("--pid", type=_pid_arg, action="append", default=[], metavar="NAME=PID")
    parser.add_argument("--tree", type=_pid_arg, action="append", default=[], metavar="NAME=PID",
                        help="like --pid, with every process under PID")  # fmt: skip
    parser.add_argument("--cpu", type=int, action="append", help="pin this process to core(s)")
    args = parser.parse_args(argv)
    if args.cpu:
        os.sched_setaffinity(0, set(args.cpu))
    body = request_body(
        args.endpoint, args.model, args.prompt, args.max_tokens, args.stream, args.store
    )
    coro = run_load(
        args.url.rstrip("/") + PATHS[args.endpoint],
        body,
        stream=args.stream,
        concurrency=args.concurrency,
        warmup=args.warmup,
        duration=args.duration,
        watched=Watched(pids=dict(args.pid), trees=dict(args.tree)),
    )
    result = _run(coro)
    sys.stdout.buffer.write(orjson.dumps(result) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
