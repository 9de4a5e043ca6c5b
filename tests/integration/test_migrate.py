"""Drain with migration through real processes: `baton backends drain ID --migrate` moves
every stream in flight on that backend to another one with the resume protocol. The
clients see unbroken, byte-identical streams and the engine is left idle, ready for a
restart."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.client import AdminClient
from tests.integration.harness import MODEL, fleet, http, metric, start_sim, wait_until

pytestmark = pytest.mark.timeout(90)

TOKENS = 200
STREAMS = 4  # round robin puts half of them on s0
# 200 tokens: 5 s, long enough to drain mid-stream even on a loaded machine (the drain is one
# gRPC call from here; the CLI's own start, seconds on a busy machine, outlived 3 s streams).
SLOW = ("--decode-ms-per-step", "25")


def prompt(i: int) -> str:
    return f"migration story number {i}"


class Reader(threading.Thread):
    """One greedy streaming completion, read chunk by chunk; `started` is set once a few
    tokens have arrived, so the stream is surely in flight on its backend."""

    def __init__(self, base_url: str, i: int) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60)
        self.i = i
        self.text = ""
        self.chunks: list[Any] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for ch in self.client.completions.create(
                model=MODEL, prompt=prompt(self.i), temperature=0, max_tokens=TOKENS,
                stream=True, stream_options={"include_usage": True},
            ):  # fmt: skip
                self.chunks.append(ch)
                if ch.choices:
                    self.text += ch.choices[0].text
                if len(self.chunks) >= 5:
                    self.started.set()
        except BaseException as exc:  # reported by the test thread
            self.error = exc
        finally:
            self.started.set()


@pytest.mark.parametrize("vocab", [(), ("--byte-level",)], ids=["ascii", "bytes"])
def test_drain_with_migrate_moves_in_flight_streams_invisibly(
    tmp_path: Path, vocab: tuple[str, ...]
) -> None:
    """Byte-level sims too: the move lands wherever the stream is, mid-character or not."""
    ref = start_sim(*vocab)
    try:
        want = {}
        for i in range(STREAMS):
            c = openai.OpenAI(base_url=ref.ready + "/v1", api_key="x", max_retries=0)
            r = c.completions.create(model=MODEL, prompt=prompt(i), temperature=0,
                                     max_tokens=TOKENS)  # fmt: skip
            want[i] = r.choices[0].text
    finally:
        ref.stop()

    with fleet(tmp_path, n=2, sim_args=(*SLOW, *vocab), probe_interval=60) as f:
        s0 = f.sims["s0"].ready
        readers = [Reader(f.base_url, i) for i in range(STREAMS)]
        for r in readers:
            r.start()
        assert all(r.started.wait(20) for r in readers)
        assert metric(s0, "vllm:num_requests_running") == STREAMS // 2

        with AdminClient(f.control.ready, timeout=10.0) as admin:
            assert admin.drain_backend("s0", migrate=True).migrating
        # The engine is idle within moments, while the streams it served still run.
        assert wait_until(lambda: metric(s0, "vllm:num_requests_running") == 0, 3)
        assert any(r.is_alive() for r in readers)
        assert f.backends()["s0"]["in_flight"] == 0
        admitted = metric(s0, "vllm:prompt_tokens_total")

        for r in readers:
            r.join(30)
        for r in readers:
            assert r.error is None, r.error
            assert r.text == want[r.i], r.i
            assert len({ch.id for ch in r.chunks}) == 1
            finishes = [ch.choices[0].finish_reason for ch in r.chunks if ch.choices]
            assert finishes.count("length") == 1 and finishes[-1] == "length"
            assert r.chunks[-1].usage is not None
            assert r.chunks[-1].usage.completion_tokens == TOKENS

        events: list[dict[str, Any]] = []

        def moved() -> bool:
            res = f.baton("events", "--kind", "failover", "--json")
            events[:] = json.loads(res.stdout) if res.returncode == 0 else []
            return len(events) >= STREAMS // 2

        assert wait_until(moved, 5)
        assert len(events) == STREAMS // 2
        for e in events:
            assert (e["from_backend"], e["to_backend"]) == ("s0", "s1")
            assert e["failure"] == "migrate" and e["outcome"] == "resumed"
            assert e["path"] == "token" and e["seam"] == "verified"

        # A drained backend gets no new requests; the rest of the fleet serves them.
        for i in range(3):
            status, _ = http(
                "POST",
                f.base_url + "/completions",
                json.dumps({"model": MODEL, "prompt": prompt(i), "max_tokens": 2}).encode(),
                {"Content-Type": "application/json"},
            )
            assert status == 200
        assert metric(s0, "vllm:prompt_tokens_total") == admitted
        row = f.backends()["s0"]
        assert row["state"] == "draining" and row["in_flight"] == 0


def test_migration_with_nowhere_to_go_keeps_the_stream_where_it_is(tmp_path: Path) -> None:
    """Drain --migrate on the only backend: no stream becomes an error; they finish where
    they are, as with a plain drain."""
    with fleet(tmp_path, n=1, sim_args=SLOW, probe_interval=60) as f:
        reader = Reader(f.base_url, 0)
        reader.start()
        assert reader.started.wait(20)
        with AdminClient(f.control.ready, timeout=10.0) as admin:
            assert admin.drain_backend("s0", migrate=True).migrating
        assert reader.is_alive()  # drained mid-stream, with nowhere to move it
        reader.join(30)
        assert reader.error is None, reader.error
        finishes = [ch.choices[0].finish_reason for ch in reader.chunks if ch.choices]
        assert finishes[-1] == "length"
        assert reader.chunks[-1].usage is not None
        assert reader.chunks[-1].usage.completion_tokens == TOKENS
