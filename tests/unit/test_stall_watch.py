"""A stalled engine is found by one lazy timer per stream (read_events' _StallWatch): over a
real aiohttp StreamReader that the test feeds, a stream that goes quiet fails as a stall after
its inter-token limit; one whose tokens keep coming never does, however long it runs in all;
the first token gets the (longer) first-token limit; and time the caller spends on events
(a slow client) is not counted against the engine."""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp
import pytest

from baton.model import Failure
from dataplane.exceptions import StreamFailed
from dataplane.settings import ResumeSettings
from dataplane.upstream.engine import read_events

pytestmark = pytest.mark.timeout(30)

# Seconds. Every gap a test means as "in time" is a quarter of it at most: a loaded machine
# (CI's two cores, a real engine starting beside the suite) can hold this process off the
# CPU for a good part of a second, and a stall is judged on the loop's clock.
INTER = 0.5


def event(n: int) -> bytes:
    return b'data: {"n": %d}\n\n' % n


async def relay(
    feed: list[tuple[float, bytes]], *, first: float = INTER, busy: float = 0.0
) -> tuple[list[bytes], Failure | None, float]:
    """Feed `(after seconds, bytes)` into a reader while read_events reads it (the caller
    spending `busy` seconds on each batch); (data seen, failure, seconds taken)."""
    loop = asyncio.get_running_loop()
    reader = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 1 << 16, loop=loop)

    async def engine() -> None:
        for after, data in feed:
            await asyncio.sleep(after)
            reader.feed_data(data)

    feeding = asyncio.create_task(engine())
    settings = ResumeSettings(first_token_timeout=first, inter_token_timeout=INTER)
    seen: list[bytes] = []
    failure = None
    started = loop.time()
    try:
        async for events in read_events(reader, b"", settings, False):
            seen += [e.data for e in events]
            if b"[DONE]" in seen:
                break
            await asyncio.sleep(busy)
    except StreamFailed as exc:
        failure = exc.failure
    feeding.cancel()
    return seen, failure, loop.time() - started


def test_a_stream_that_goes_quiet_fails_as_a_stall_after_its_limit() -> None:
    seen, failure, took = asyncio.run(relay([(0, event(1)), (0.05, event(2))]))
    assert (len(seen), failure) == (2, Failure.STALL)
    assert INTER <= took < INTER + 1.0


def test_tokens_that_keep_coming_are_never_a_stall() -> None:
    """Five times the limit in all, each gap a quarter of it: a per-read deadline, not a
    total."""
    steps = [(INTER / 4, event(i)) for i in range(20)] + [(0, b"data: [DONE]\n\n")]
    seen, failure, _ = asyncio.run(relay(steps))
    assert failure is None and len(seen) == 21


def test_the_first_token_gets_the_first_token_limit() -> None:
    seen, failure, _ = asyncio.run(
        relay([(INTER * 2, event(1)), (0, b"data: [DONE]\n\n")], first=INTER * 5)
    )
    assert failure is None and len(seen) == 2
    # And it is a limit: none at all within it is a stall.
    seen, failure, took = asyncio.run(relay([(INTER * 10, event(1))], first=INTER * 3))
    assert (seen, failure) == ([], Failure.STALL) and took < INTER * 6


def test_time_the_caller_spends_on_events_is_not_the_engines() -> None:
    """A slow client: each batch takes the caller twice the limit, while the engine has
    long sent the next token."""
    steps = [(0.01, event(i)) for i in range(3)] + [(0.01, b"data: [DONE]\n\n")]
    seen, failure, took = asyncio.run(relay(steps, busy=INTER * 2))
    assert took > INTER * 2  # the caller was busy past the limit, with a read to come
    assert failure is None and b"[DONE]" in seen
