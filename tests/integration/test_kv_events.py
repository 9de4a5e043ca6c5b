"""Control subscribes to an engine's KV-cache events: control as a real process, and in this
process a publisher that speaks vLLM's ZMQ protocol (a PUB socket sending (topic, seq, payload)
frames, a ROUTER socket answering replay requests, as vllm/distributed/kv_events.py's
ZmqEventPublisher does). Its msgspec Structs are written here, apart from control's decoder, so
a mismatch between the two fails these tests."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    cli,
    cli_json,
    http,
    start_control,
    start_sim,
    wait_until,
    write_config,
)

BS = 16
TOPIC = b"kv"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# vLLM's wire types, as vllm/distributed/kv_events.py declares them.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class Publisher:
    """vLLM's ZmqEventPublisher in miniature: bound PUB and ROUTER sockets, a replay buffer,
    sequence numbers from 0. `skip` publishes a batch to the buffer only (a lost message)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        # What an engine sees of its subscribers: each one that goes away is a disconnect.
        self.monitor = self.pub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, *events: KVCacheEvent, skip: bool = False) -> int:
        payload = msgspec.msgpack.encode(EventBatch(1.0, list(events), 0))
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
            if not skip:
                self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, empty, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                self.replays += 1
                for seq, payload in self.buffer:
                    if seq >= first:
                        self.router.send_multipart(
                            [client, empty, TOPIC, seq.to_bytes(8, "big"), payload]
                        )
                self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def subscriber_left(self, timeout: float = 10.0) -> bool:
        """A subscriber (control's SUB) disconnected within `timeout` seconds."""
        while self.monitor.poll(int(timeout * 1000)):
            if parse_monitor_message(self.monitor.recv_multipart())["event"] == (
                zmq.EVENT_DISCONNECTED
            ):
                return True
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.pub.disable_monitor()
        self.monitor.close(linger=0)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def blocks(first: int, n: int, parent: int | None) -> BlockStored:
    """n full blocks with engine hashes first..first+n-1 (token ids from the hashes)."""
    tokens = [t for h in range(first, first + n) for t in [h] * BS]
    return BlockStored(list(range(first, first + n)), parent, tokens, BS, None, "GPU", None,
                       extra_keys=[None] * n, group_idx=0)  # fmt: skip


def start(tmp_path: Path, pub: Publisher, replay: bool = True) -> Part:
    extra = f'kv_events = "{pub.endpoint}"'
    if replay:
        extra += f'\nkv_events_replay = "{pub.replay_endpoint}"'
    # Nothing listens at the url: the backend is down, its KV events flow regardless.
    config = write_config(tmp_path / "control.toml", [("e0", "http://127.0.0.1:9")],
                          backend_extra=extra, extra="[kv]\nreplay_timeout = 5.0\n")  # fmt: skip
    return start_control(config)


def rows(control: Part) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in cli_json(control, "backends", "list")}


def kv(control: Part, bid: str = "e0") -> dict[str, Any]:
    return rows(control)[bid]


def live_with(control: Part, n: int, bid: str = "e0") -> bool:
    row = kv(control, bid)
    return bool(row["kv_index"] == "live" and row["kv_blocks"] == n)


def scrape(control: Part) -> str:
    _, text = http("GET", control.announced["METRICS"])
    return text.decode()


def connected(control: Part, pub: Publisher, probe: KVCacheEvent | None = None) -> None:
    """Control's SUB is connected (the index is live) and its subscription has reached the
    PUB socket, which drops what it sends before: publish probes (by default a cleared
    cache) until one has arrived. The first to arrive may not be the first sent, and then
    control catches up on the ones before from the replay socket."""
    assert wait_until(lambda: kv(control)["kv_index"] == "live", timeout=20)
    event = probe or AllBlocksCleared()
    kind = "cleared" if isinstance(event, AllBlocksCleared) else "removed"
    seen = re.compile(rf'baton_kv_events_total{{backend="e0",event="{kind}"}} [1-9]')

    def probed() -> bool:
        pub.publish(event)
        return wait_until(lambda: seen.search(scrape(control)) is not None, timeout=0.5)

    assert wait_until(probed, timeout=20)
    assert wait_until(lambda: kv(control)["kv_index"] == "live", timeout=20)


def kv_events(control: Part) -> list[dict[str, Any]]:
    return list(cli_json(control, "events", "--kind", "kv"))


def test_control_keeps_an_index_of_the_blocks_an_engine_holds(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    pub = Publisher(ctx)
    control = start(tmp_path, pub)
    try:
        connected(control, pub)
        pub.publish(blocks(1, 3, None))
        pub.publish(blocks(4, 2, 3), BlockRemoved([5], "GPU", group_idx=0))
        assert wait_until(lambda: live_with(control, 4))
        body = scrape(control)
        assert 'baton_kv_index_state{backend="e0",state="live"} 1.0' in body
        assert 'baton_kv_blocks{backend="e0"} 4.0' in body
        assert 'baton_kv_events_total{backend="e0",event="stored"} 2.0' in body
        # A cleared cache empties the index.
        pub.publish(AllBlocksCleared())
        assert wait_until(lambda: live_with(control, 0))
    finally:
        control.stop(grace=3)
        pub.close()


def test_a_sequence_gap_is_replayed_from_the_engine(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    pub = Publisher(ctx)
    control = start(tmp_path, pub)
    try:
        connected(control, pub)
        pub.publish(blocks(1, 2, None))
        assert wait_until(lambda: live_with(control, 2))
        replays = pub.replays  # a catch-up on the probes, if the first one was lost
        pub.publish(blocks(3, 2, 2), skip=True)  # lost on the way
        pub.publish(BlockRemoved([1], "GPU"), skip=True)
        pub.publish(blocks(5, 1, 4))  # shows the gap: seqs 1 and 2 are asked for again
        assert wait_until(lambda: live_with(control, 4))
        assert pub.replays == replays + 1
        states = [(e["previous"], e["state"]) for e in kv_events(control)]
        assert ("live", "replaying") in states and states[-1] == ("replaying", "live")
    finally:
        control.stop(grace=3)
        pub.close()


def test_an_engine_that_cached_blocks_before_control_started_is_caught_up(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """An engine that ran before control (control restarted, or started second): its first
    batches went to nobody, but it holds their blocks. Control asks its replay socket for
    them, so a continuation there is credited from the first batch control sees."""
    pub = Publisher(ctx)
    pub.publish(blocks(1, 3, None))  # no subscriber yet: only the engine's buffer has it
    pub.publish(blocks(4, 1, 3))
    control = start(tmp_path, pub)
    try:
        connected(control, pub, probe=BlockRemoved([999], "GPU"))  # removes nothing held
        assert wait_until(lambda: live_with(control, 4)), kv(control)
        assert pub.replays >= 1
        states = [(e["previous"], e["state"], e["reason"]) for e in kv_events(control)]
        assert any(s[:2] == ("live", "replaying") and "before control subscribed" in s[2]
                   for s in states), states  # fmt: skip
        assert states[-1][:2] == ("replaying", "live") and "caught up from seq 0" in states[-1][2]
    finally:
        control.stop(grace=3)
        pub.close()


def test_a_publisher_restart_clears_the_index(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    pub = Publisher(ctx)
    control = start(tmp_path, pub)
    try:
        connected(control, pub)
        pub.publish(blocks(1, 3, None))
        pub.publish(blocks(4, 2, 3))
        assert wait_until(lambda: live_with(control, 5))
        # The engine starts over on the same socket: its sequence begins at 0 again.
        with pub._lock:
            pub.seq, pub.buffer = 0, []
        pub.publish(blocks(10, 1, None))
        assert wait_until(lambda: live_with(control, 1))
        assert any("restarted" in e["reason"] for e in kv_events(control))
    finally:
        control.stop(grace=3)
        pub.close()


def test_a_publisher_that_goes_away_turns_the_index_lost(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    pub = Publisher(ctx)
    control = start(tmp_path, pub, replay=False)
    try:
        connected(control, pub)
        pub.publish(blocks(1, 2, None))
        assert wait_until(lambda: live_with(control, 2))
        pub.close()
        assert wait_until(lambda: kv(control)["kv_index"] == "lost", timeout=15)
        row = kv(control)
        assert row["kv_blocks"] == 0 and "disconnected" in row["kv_reason"]
        last = kv_events(control)[-1]
        assert (last["previous"], last["state"]) == ("live", "lost")
        assert last["backend_id"] == "e0" and last["blocks_before"] == 2
        assert 'baton_kv_index_state{backend="e0",state="lost"} 1.0' in scrape(control)
    finally:
        control.stop(grace=3)


def test_a_backend_removed_at_run_time_stops_its_subscription_and_re_adding_it_resumes(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    pub, elsewhere = Publisher(ctx), Publisher(ctx)
    control = start(tmp_path, pub)
    try:
        connected(control, pub)
        pub.publish(blocks(1, 3, None))
        assert wait_until(lambda: live_with(control, 3))
        cli_json(control, "backends", "remove", "e0")
        assert pub.subscriber_left()  # the engine sees control go
        assert 'backend="e0"' not in scrape(control)
        # Re-added without kv_events: the config file's do not come back with it.
        url = ("--url", "http://127.0.0.1:9", "--model", MODEL)
        cli_json(control, "backends", "add", "e0", *url)
        assert kv(control)["kv_index"] == "off" and kv(control)["kv_events"] == ""
        cli_json(control, "backends", "remove", "e0")
        # Re-added with another engine's: subscribed there, afresh (the old blocks are gone).
        cli_json(control, "backends", "add", "e0", *url, "--kv-events", elsewhere.endpoint,
                 "--kv-events-replay", elsewhere.replay_endpoint)  # fmt: skip
        assert wait_until(lambda: kv(control)["kv_index"] == "live", timeout=20)
        assert wait_until(lambda: elsewhere.publish(blocks(7, 1, None)) >= 0
                          and live_with(control, 1))  # fmt: skip
        assert kv(control)["kv_events_replay"] == elsewhere.replay_endpoint
    finally:
        control.stop(grace=3)
        pub.close()
        elsewhere.close()


def on_loopback(endpoint: str) -> str:
    """The sim binds tcp://*:0 as vLLM binds its sockets and reports tcp://0.0.0.0:PORT;
    control connects to it on the loopback address."""
    return endpoint.replace("//0.0.0.0:", "//127.0.0.1:")


def test_an_engine_added_at_run_time_with_kv_events_is_indexed_until_removed(
    tmp_path: Path,
) -> None:
    sim = start_sim("--kv-block-size", "8", "--kv-events-endpoint", "tcp://*:0",
                    "--kv-events-replay-endpoint", "tcp://*:0")  # fmt: skip
    pub, replay = (on_loopback(sim.announced[k]) for k in ("KV_EVENTS", "KV_REPLAY"))
    # No backend at all at start, so none with kv_events: the subscriptions come with adds.
    config = write_config(tmp_path / "control.toml", [])
    data = ("--data-dir", str(tmp_path / "data"))
    control = start_control(config, *data)
    try:
        added = cli_json(control, "backends", "add", "a0", "--url", sim.ready, "--model", MODEL,
                         "--kv-events", pub, "--kv-events-replay", replay)  # fmt: skip
        assert (added["kv_events"], added["kv_events_replay"]) == (pub, replay)
        assert wait_until(lambda: kv(control, "a0")["kv_index"] == "live", timeout=20)
        # A prompt of many blocks straight to the engine: it stores them and says so.
        prompt = json.dumps({"model": MODEL, "prompt": "the quick brown fox " * 20,
                             "max_tokens": 1}).encode()  # fmt: skip
        status, _ = http("POST", sim.ready + "/v1/completions", prompt,
                         {"Content-Type": "application/json"})  # fmt: skip
        assert status == 200
        assert wait_until(lambda: kv(control, "a0")["kv_blocks"] >= 4, timeout=20)
        assert 'baton_kv_index_state{backend="a0",state="live"} 1.0' in scrape(control)
        head, row = cli(control, "backends", "list").splitlines()
        assert "KV EVENTS" in head and pub in row.split() and replay in row.split()

        # A restart keeps the operator's addition, endpoints and all: subscribed again.
        control.stop(grace=3)
        control = start_control(config, *data)
        assert wait_until(lambda: kv(control, "a0")["kv_index"] == "live", timeout=20)
        assert kv(control, "a0")["kv_events"] == pub

        cli_json(control, "backends", "remove", "a0")
        assert rows(control) == {}
        assert 'backend="a0"' not in scrape(control)  # its index is gone with it
    finally:
        control.stop(grace=3)
        sim.stop(grace=3)
