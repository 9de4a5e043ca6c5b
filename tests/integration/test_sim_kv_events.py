"""The sim publishes KV-cache events as vLLM 0.32 does (real sim processes, ZMQ on 127.0.0.1).

The subscriber here decodes with its own copy of vLLM's msgspec structs (below, as
vllm/distributed/kv_events.py defines them), so a format drift in sim/kv_wire.py fails.
Endpoints come from GET /kv_event_sources, vLLM's own report of where it publishes.
Every wait is a bounded poll on state."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from clients.procs import Part
from tests.integration.harness import http, metric, start_sim, wait_until

# -- vLLM 0.32's structs, as vllm/distributed/kv_events.py has them ---------------------
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BS = 4  # block size for these tests
Ctx = zmq.Context[zmq.Socket[bytes]]
VLLM_PY = Path("/root/.cache/baton-engines/vllm-venv/bin/python")


# -- helpers -------------------------------------------------------------------------
def kv_sim(*extra: str) -> Part:
    return start_sim("--kv-block-size", str(BS), "--kv-cache-blocks", "256", *extra)


def bound_sim(*extra: str) -> Part:
    return kv_sim(
        "--kv-events-endpoint", "tcp://*:0",
        "--kv-events-replay-endpoint", "tcp://127.0.0.1:0", *extra,
    )  # fmt: skip


def sources(sim: Part) -> dict[str, Any]:
    status, body = http("GET", sim.ready + "/kv_event_sources")
    assert status == 200
    return json.loads(body)


def complete(sim: Part, prompt: list[int], max_tokens: int = 1) -> list[int]:
    """A completion on token ids; the ids it generated."""
    body = {"model": "toy", "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}
    status, data = http("POST", sim.ready + "/v1/completions", json.dumps(body).encode(),
                        {"Content-Type": "application/json"})  # fmt: skip
    assert status == 200, data
    ids: list[int] = json.loads(data)["choices"][0]["token_ids"]
    return ids


def replay(ctx: Ctx, endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol: send the start seq, read batches until the END_SEQ frame."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(5000), "replay did not answer"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


class Subscriber:
    """Live batches on SUB, gaps (a slow join, a missed tail) filled from the replay socket."""

    def __init__(self, ctx: Ctx, source: dict[str, Any]) -> None:
        self.ctx = ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, source["topic"].encode())
        self.sub.connect(source["endpoint"])
        self.replay_endpoint: str = source["replay_endpoint"]
        self.batches: dict[int, KVEventBatch] = {}
        self.raw: dict[int, bytes] = {}
        self.live: list[int] = []

    def close(self) -> None:
        self.sub.close(linger=0)

    def _add(self, seq: int, payload: bytes) -> None:
        self.batches.setdefault(seq, DECODE.decode(payload))
        self.raw.setdefault(seq, payload)

    def next_missing(self) -> int:
        n = 0
        while n in self.batches:
            n += 1
        return n

    def events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        n = self.next_missing()
        return [e for s in range(n) for e in self.batches[s].events]

    def wait_for(self, check: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while self.sub.poll(50):
                _topic, seq, payload = self.sub.recv_multipart()
                self.live.append(int.from_bytes(seq, "big"))
                self._add(int.from_bytes(seq, "big"), payload)
            if check(self.events()):
                return self.events()
            missed = replay(self.ctx, self.replay_endpoint, self.next_missing())
            for _topic, seq_no, payload in missed:
                self._add(seq_no, payload)
        raise AssertionError(f"no such events within {timeout}s: {self.events()}")


def stores(events: list[Any], first_token: int) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.token_ids[0] == first_token]


@pytest.fixture(scope="module")
def sim() -> Iterator[Part]:
    p = bound_sim()
    yield p
    p.stop(grace=3)


@pytest.fixture
def sub(sim: Part, ctx: Ctx) -> Iterator[Subscriber]:
    s = Subscriber(ctx, sources(sim)["0"])
    yield s
    s.close()


# -- tests ---------------------------------------------------------------------------
def test_sources_report_the_bound_endpoints_as_vllm_does(sim: Part) -> None:
    src = sources(sim)
    assert list(src) == ["0"]
    s = src["0"]
    assert s["enable_kv_cache_events"] is True and s["publisher"] == "zmq"
    assert (s["buffer_steps"], s["hwm"], s["max_queue_size"], s["topic"]) == (
        10_000, 100_000, 100_000, "")  # fmt: skip
    assert s["endpoint"].startswith("tcp://0.0.0.0:") and not s["endpoint"].endswith(":0")
    assert s["replay_endpoint"].startswith("tcp://127.0.0.1:")
    # The same endpoints on the lines before SIM READY.
    assert sim.announced == {"KV_EVENTS": s["endpoint"], "KV_REPLAY": s["replay_endpoint"]}


def test_off_without_an_endpoint() -> None:
    p = kv_sim()
    try:
        assert sources(p) == {}
        assert p.announced == {}
    finally:
        p.stop(grace=3)


def test_prompt_blocks_then_only_the_new_blocks_of_a_shared_prefix(
    sim: Part, sub: Subscriber
) -> None:
    a = list(range(20, 30))  # 2 full blocks and 2 tokens
    complete(sim, a)
    (first,) = sub.wait_for(lambda ev: bool(stores(ev, 20)))[-1:]
    assert isinstance(first, BlockStored)
    assert first.token_ids == a[:8] and first.parent_block_hash is None
    assert len(first.block_hashes) == 2 and len(set(first.block_hashes)) == 2
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first.block_hashes)
    assert (first.block_size, first.medium) == (BS, "GPU")
    assert (first.lora_id, first.lora_name, first.session_id) == (None, None, None)
    assert (first.group_idx, first.kv_cache_spec_kind, first.extra_keys) == (
        0, "full_attention", [None, None])  # fmt: skip

    b = [*a[:8], 40, 41, 42, 43, 44]  # shares 2 blocks, adds 1 full block
    complete(sim, b)
    events = sub.wait_for(lambda ev: any(e.token_ids == b[8:12] for e in stores(ev, 40)))
    (second,) = stores(events, 40)
    assert len(second.block_hashes) == 1
    assert second.parent_block_hash == first.block_hashes[-1]  # linked to the shared prefix
    assert len(stores(events, 20)) == 1  # the shared blocks were not stored again
    assert metric(sim.ready, "vllm:prefix_cache_hits_total") >= 8


def test_generated_full_blocks_are_stored_as_decoding_fills_them(
    sim: Part, sub: Subscriber
) -> None:
    prompt = list(range(60, 68))  # 2 blocks
    out = complete(sim, prompt, max_tokens=9)  # 8 computed (the 9th is never fed back)
    events = sub.wait_for(lambda ev: len(stores(ev, 60)) == 1 and any(
        e.parent_block_hash is not None and e.token_ids[:4] == out[:4]
        for e in ev if isinstance(e, BlockStored)))  # fmt: skip
    (head,) = stores(events, 60)
    (tail,) = [e for e in events if isinstance(e, BlockStored) and e.token_ids[:4] == out[:4]]
    assert tail.token_ids == out[:8] and len(tail.block_hashes) == 2
    assert tail.parent_block_hash == head.block_hashes[-1]


def test_sequence_numbers_rise_from_zero_and_a_late_subscriber_replays(
    sim: Part, ctx: Ctx
) -> None:
    src = sources(sim)["0"]
    for i in range(3):
        complete(sim, [80 + i] * 8)
    got: list[tuple[bytes, int, bytes]] = []

    def all_three() -> bool:
        got[:] = replay(ctx, src["replay_endpoint"], 0)
        events = [e for _, _, p in got for e in DECODE.decode(p).events]
        return all(stores(events, 80 + i) for i in range(3))

    assert wait_until(all_three)
    seqs = [s for _, s, _ in got]
    assert seqs == list(range(len(seqs)))  # every batch since start, from 0, in order
    assert {t for t, _, _ in got} == {b""}
    tail = replay(ctx, src["replay_endpoint"], seqs[-1])
    assert [s for _, s, _ in tail] == [seqs[-1]] and tail[0][2] == got[-1][2]
    assert replay(ctx, src["replay_endpoint"], seqs[-1] + 1) == []


def test_reset_clears_every_block(sim: Part, sub: Subscriber) -> None:
    prompt = list(range(90, 98))
    complete(sim, prompt)
    sub.wait_for(lambda ev: bool(stores(ev, 90)))
    status, body = http("POST", sim.ready + "/reset_prefix_cache")
    assert (status, json.loads(body)) == (200, {"success": True})
    sub.wait_for(lambda ev: isinstance(ev[-1], AllBlocksCleared))
    complete(sim, prompt)  # nothing is cached now: its blocks are stored again
    events = sub.wait_for(lambda ev: len(stores(ev, 90)) == 2)
    assert stores(events, 90)[0] == stores(events, 90)[1]


def test_a_small_cache_evicts_least_recent_blocks_tail_first(
    ctx: Ctx,
) -> None:
    p = bound_sim("--kv-cache-blocks", "3")
    try:
        sub = Subscriber(ctx, sources(p)["0"])
        complete(p, list(range(110, 118)))  # A: 2 blocks, cached when it ends
        complete(p, list(range(130, 138)))  # B: 2 blocks, 1 free: A's tail goes
        complete(p, list(range(150, 158)))  # C: then A's head and B's tail
        events = sub.wait_for(lambda ev: len(stores(ev, 150)) == 1)
        a, b = stores(events, 110)[0].block_hashes, stores(events, 130)[0].block_hashes
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert [e.block_hashes for e in removed] == [[a[1]], [a[0]], [b[1]]]
        assert all((e.medium, e.group_idx) == ("GPU", 0) for e in removed)
        # A removal comes before the store that needed the block.
        assert events.index(removed[0]) < events.index(stores(events, 130)[0])
        sub.close()
    finally:
        p.stop(grace=3)


def test_the_replay_buffer_is_bounded_and_vllms_config_flag_works(
    ctx: Ctx,
) -> None:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
           "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv", "buffer_steps": 2}  # fmt: skip
    p = kv_sim("--kv-events-config", json.dumps(cfg))
    try:
        src = sources(p)["0"]
        assert (src["topic"], src["buffer_steps"]) == ("kv", 2)
        for i in range(4):
            complete(p, [170 + i] * 4)
        got: list[tuple[bytes, int, bytes]] = []

        def last_is_3() -> bool:
            got[:] = replay(ctx, src["replay_endpoint"], 0)
            return bool(got) and got[-1][1] == 3

        assert wait_until(last_is_3)
        assert [(t, s) for t, s, _ in got] == [(b"kv", 2), (b"kv", 3)]
    finally:
        p.stop(grace=3)


def _wait_connected(sub: zmq.Socket[bytes], start: Callable[[], Part]) -> Part:
    """Start a sim whose PUB connects to `sub`, and wait until the handshake is done."""
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        part = start()
        assert mon.poll(10_000), "the sim's PUB never connected"
        mon.recv_multipart()
        # A bound SUB attaches a new peer, and sends it the subscription, only when its own
        # thread calls into it (as a subscriber's receive loop always does).
        assert not sub.poll(50)
        return part
    finally:
        sub.disable_monitor()
        mon.close(linger=0)


def test_connect_arrangement_and_a_restart_starts_again_from_zero(
    ctx: Ctx,
) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"  # no '*': the sim connects, the subscriber binds
    seen: list[list[int]] = []
    try:
        for run in range(2):
            p = _wait_connected(sub, lambda: kv_sim("--kv-events-endpoint", endpoint))
            try:
                assert sources(p)["0"]["endpoint"] == endpoint
                assert sources(p)["0"]["replay_endpoint"] is None
                for i in range(2):
                    complete(p, [190 + 10 * run + i] * 4)
                seqs: list[int] = []
                while len(seqs) < 2:
                    assert sub.poll(10_000), f"no live batch (run {run}, got {seqs})"
                    _, seq, payload = sub.recv_multipart()
                    seqs.append(int.from_bytes(seq, "big"))
                    assert stores(DECODE.decode(payload).events, 190 + 10 * run + len(seqs) - 1)
                seen.append(seqs)
            finally:
                p.stop(grace=3)
    finally:
        sub.close(linger=0)
    assert seen == [[0, 1], [0, 1]]  # a restarted engine numbers from 0 again


def test_bind_arrangement_delivers_live(sim: Part, sub: Subscriber) -> None:
    """A SUB connecting to the bound PUB gets batches live once its subscription is in."""
    n = 0

    def live_one() -> bool:
        nonlocal n
        n += 1
        complete(sim, [220 + n] * 4)
        before = len(sub.live)
        sub.wait_for(lambda ev: bool(stores(ev, 220 + n)))
        return len(sub.live) > before

    assert wait_until(live_one, timeout=15)


def test_load_gauges_follow_running_and_waiting_requests(sim: Part) -> None:
    del sim  # a paced sim of its own: requests must stay running for a while
    p = kv_sim("--decode-ms-per-step", "20", "--max-num-seqs", "1")
    try:
        threads = [threading.Thread(target=complete, args=(p, [250 + i] * 10, 40))
                   for i in range(3)]  # fmt: skip
        for t in threads:
            t.start()

        def busy() -> bool:
            return (metric(p.ready, "vllm:num_requests_running") == 1
                    and metric(p.ready, "vllm:num_requests_waiting") == 2
                    and metric(p.ready, "vllm:kv_cache_usage_perc") > 0)  # fmt: skip

        assert wait_until(busy)
        # vLLM refuses a reset while running requests hold blocks.
        status, body = http("POST", p.ready + "/reset_prefix_cache")
        assert (status, json.loads(body)) == (200, {"success": False})
        for t in threads:
            t.join(30)

        def idle() -> bool:
            return (metric(p.ready, "vllm:num_requests_running") == 0
                    and metric(p.ready, "vllm:num_requests_waiting") == 0
                    and metric(p.ready, "vllm:kv_cache_usage_perc") == 0)  # fmt: skip

        assert wait_until(idle)
    finally:
        p.stop(grace=3)


@pytest.mark.real
@pytest.mark.skipif(not VLLM_PY.exists(), reason="no vLLM venv (make engines)")
def test_vllms_own_decoder_reads_the_sims_batches(
    ctx: Ctx, tmp_path: Path
) -> None:
    """vLLM's KVEventBatch decodes every kind of batch the sim sends to what our copy
    decodes, and re-encodes it to the same bytes."""
    p = bound_sim("--kv-cache-blocks", "4")
    try:
        sub = Subscriber(ctx, sources(p)["0"])
        for base in (110, 130):
            complete(p, list(range(base, base + 8)), max_tokens=6)
        http("POST", p.ready + "/reset_prefix_cache")
        events = sub.wait_for(lambda ev: bool(ev) and isinstance(ev[-1], AllBlocksCleared))
        assert {type(e) for e in events} == {BlockStored, BlockRemoved, AllBlocksCleared}
        payloads = [sub.raw[s] for s in range(sub.next_missing())]
        sub.close()
    finally:
        p.stop(grace=3)
    (tmp_path / "batches.msgpack").write_bytes(msgspec.msgpack.encode(payloads))
    script = (
        "import sys, json, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "dec = msgspec.msgpack.Decoder(KVEventBatch)\n"
        "raw = msgspec.msgpack.decode(open(sys.argv[1], 'rb').read())\n"
        "out = []\n"
        "for p in raw:\n"
        "    b = dec.decode(p)\n"
        "    assert msgspec.msgpack.encode(b) == p, 'vLLM re-encodes differently'\n"
        "    out.append(msgspec.to_builtins(b))\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([str(VLLM_PY), "-c", script, str(tmp_path / "batches.msgpack")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = json.loads(json.dumps([msgspec.to_builtins(DECODE.decode(p)) for p in payloads]))
    assert theirs == ours
