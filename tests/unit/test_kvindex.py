"""The KV index (control/signals/kv/index.py) as a table of events in, answers out, and Baton's
block keys (baton/blocks.py); the registry's read method and its audit events."""

from __future__ import annotations

import pytest

from baton.blocks import ROOT, block_key, block_keys
from baton.model import BackendId
from control.audit.log import EventQuery
from control.audit.payloads import EventKind
from control.backend_spec import make_backend
from control.fleet.registry import Registry
from control.signals.kv.index import Cleared, Fed, KvIndex, KvState, Removed, Stored
from control.signals.kv.wire import BlockStored, KVEventBatch, decode, to_events

A, B = BackendId("a"), BackendId("b")
BS = 4
PROMPT = tuple(range(100, 114))  # 3 full blocks of 4 and 2 tokens over


def stored(hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...],
           keyable: bool = True) -> Stored:  # fmt: skip
    return Stored(hashes, parent, tokens, BS, keyable)


def live(*backends: BackendId, capacity: int = 1000) -> KvIndex:
    index = KvIndex(capacity)
    for bid in backends:
        index.watch(bid, 0.0)
        index.connected(bid, 0.0)
    return index


# -- block keys --------------------------------------------------------------------------


def test_block_keys_cover_full_blocks_only_and_chain_from_the_parent() -> None:
    keys = block_keys(PROMPT, BS)
    assert len(keys) == 3
    assert keys[0] == block_key(ROOT, PROMPT[:4])
    assert keys[2] == block_key(keys[1], PROMPT[8:12])
    # Chaining from a block's key continues the same chain: an engine's event for blocks 1..2
    # keyed from block 0's key gives the request's own keys.
    assert block_keys(PROMPT[4:12], BS, keys[0]) == keys[1:]
    assert block_keys(PROMPT[:3], BS) == []


def test_block_keys_are_stable_64_bit_and_depend_on_the_whole_prefix() -> None:
    # Fixed values: the same on every process and machine (no seed, no Python hash()).
    assert block_keys((1, 2, 3, 4), 4) == [block_key(0, (1, 2, 3, 4))]
    assert block_key(0, (1, 2, 3, 4)) == 0x6E97D4FF71FA7CD8
    k = block_key(0, (1, 2, 3, 4))
    assert 0 <= k < 2**64 and k == block_key(0, [1, 2, 3, 4])
    assert block_keys((9, 2, 3, 4, 5, 6, 7, 8), 4)[1] != block_keys((1, 2, 3, 4, 5, 6, 7, 8), 4)[1]
    with pytest.raises(ValueError):
        block_keys((1, 2), 0)
    with pytest.raises(ValueError):
        block_key(0, (-1,))


# -- stored, removed, cleared --------------------------------------------------------------


def test_stored_blocks_answer_the_leading_blocks_a_backend_holds() -> None:
    index = live(A, B)
    keys = block_keys(PROMPT, BS)
    assert index.feed(A, 0, [stored((11, 12, 13), None, PROMPT[:12])], 1.0) is Fed.APPLIED
    assert index.feed(B, 0, [stored((21,), None, PROMPT[:4])], 1.0) is Fed.APPLIED
    assert index.cached(keys, BS) == {A: 3, B: 1}
    assert index.cached(block_keys((7, 7, 7, 7), BS), BS) == {A: 0, B: 0}
    status = index.status(A)
    assert status is not None and status.blocks == 3 and status.next_seq == 1
    assert status.block_size == BS and status.events == {"stored": 1}


def test_parent_linkage_keys_a_child_event_from_its_parents_key() -> None:
    index = live(A)
    index.feed(A, 0, [stored((11,), None, PROMPT[:4])], 1.0)
    index.feed(A, 1, [stored((12, 13), 11, PROMPT[4:12])], 1.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 3}


def test_a_removed_block_ends_the_prefix_there_and_cleared_drops_everything() -> None:
    index = live(A)
    index.feed(A, 0, [stored((11, 12, 13), None, PROMPT[:12])], 1.0)
    index.feed(A, 1, [Removed((12,))], 1.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 1}
    index.feed(A, 2, [Cleared()], 1.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 0}
    status = index.status(A)
    assert status is not None and status.blocks == 0
    assert status.events == {"stored": 1, "removed": 1, "cleared": 1}


def test_an_unknown_parent_records_the_blocks_without_keys_and_never_guesses() -> None:
    index = live(A)
    # Block 0 was stored before control listened: its children cannot be keyed...
    index.feed(A, 5, [stored((12, 13), 11, PROMPT[4:12])], 1.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 0}
    # ...and neither can theirs: the chain below an unknown block stays unknown.
    index.feed(A, 6, [stored((14,), 13, (1, 2, 3, 4))], 1.0)
    status = index.status(A)
    assert status is not None and status.blocks == 0
    # Block 0 stored now is keyed; its old children stay unknown, block 1 is not held.
    index.feed(A, 7, [stored((11,), None, PROMPT[:4])], 1.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 1}


def test_lora_multimodal_or_salted_blocks_are_not_keyed_by_their_tokens() -> None:
    index = live(A)
    index.feed(A, 0, [stored((11, 12), None, PROMPT[:8], keyable=False)], 1.0)
    index.feed(A, 1, [stored((13,), 12, PROMPT[8:12])], 1.0)  # child of an unkeyed block
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 0}


def test_another_block_size_is_not_answered_for() -> None:
    index = live(A)
    index.feed(A, 0, [stored((11,), None, PROMPT[:4])], 1.0)
    assert index.cached(block_keys(PROMPT, 2), 2) == {}
    # An event whose token count does not fit its blocks is recorded without keys.
    index.feed(A, 1, [Stored((12,), 11, PROMPT[4:7], BS)], 1.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 1}


# -- sequence numbers ----------------------------------------------------------------------


def test_a_gap_is_reported_and_a_replay_fills_it_then_live_duplicates_are_dropped() -> None:
    index = live(A)
    index.feed(A, 0, [stored((11,), None, PROMPT[:4])], 1.0)
    assert index.feed(A, 3, [stored((14,), 13, (1, 2, 3, 4))], 1.0) is Fed.GAP
    status = index.status(A)
    assert status is not None and status.next_seq == 1 and status.state is KvState.LIVE
    index.begin_replay(A, 3, 2.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {}  # not live: no answer
    assert index.feed(A, 1, [stored((12,), 11, PROMPT[4:8])], 2.0) is Fed.APPLIED
    assert index.feed(A, 2, [stored((13,), 12, PROMPT[8:12])], 2.0) is Fed.APPLIED
    assert index.feed(A, 3, [Removed((13,))], 2.0) is Fed.APPLIED
    assert index.end_replay(A, 3, 2.0)
    # The live socket still delivers what the replay already did.
    assert index.feed(A, 2, [stored((13,), 12, PROMPT[8:12])], 2.0) is Fed.DUPLICATE
    assert index.feed(A, 3, [Removed((13,))], 2.0) is Fed.DUPLICATE
    assert index.feed(A, 4, [], 2.0) is Fed.APPLIED
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 2}


def test_a_replay_that_does_not_reach_the_gap_loses_the_index_and_the_next_batch_restarts_it(
) -> None:  # fmt: skip
    index = live(A)
    index.feed(A, 0, [stored((11,), None, PROMPT[:4])], 1.0)
    assert index.feed(A, 9, [], 1.0) is Fed.GAP
    index.begin_replay(A, 9, 1.0)
    # The engine's buffer no longer reaches back to seq 1.
    assert index.feed(A, 5, [], 1.0) is Fed.GAP
    assert not index.end_replay(A, 9, 1.0)
    status = index.status(A)
    assert status is not None and status.state is KvState.LOST and status.blocks == 0
    assert index.cached(block_keys(PROMPT, BS), BS) == {}
    assert index.feed(A, 9, [stored((11,), None, PROMPT[:4])], 2.0) is Fed.APPLIED
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 1}


def test_an_engine_that_ran_before_control_subscribed_is_caught_up_from_its_buffer() -> None:
    # The first batch control sees is seq 7: the engine cached the prompt's blocks in 0..6.
    index = live(A)
    index.begin_replay(A, 7, 1.0)
    status = index.status(A)
    assert status is not None and status.state is KvState.REPLAYING
    assert "before control subscribed" in status.reason
    assert index.cached(block_keys(PROMPT, BS), BS) == {}  # not live yet: no answer
    # The buffer no longer holds 0..2: what it has from 3 is applied as the index's start.
    assert index.feed(A, 3, [stored((11, 12), None, PROMPT[:8])], 1.0) is Fed.APPLIED
    for seq in range(4, 8):
        assert index.feed(A, seq, [], 1.0) is Fed.APPLIED  # the replay reached seq 7, too
    assert index.end_replay(A, 7, 1.0)
    status = index.status(A)
    assert status is not None and status.state is KvState.LIVE
    assert status.reason == "caught up from seq 3"
    assert index.feed(A, 7, [], 1.0) is Fed.DUPLICATE  # the live copy of what was replayed
    assert index.feed(A, 8, [], 1.0) is Fed.APPLIED
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 2}


def test_a_catch_up_that_falls_short_starts_the_index_at_the_live_batch_never_lost() -> None:
    index = live(A)
    index.begin_replay(A, 7, 1.0)
    assert index.feed(A, 2, [stored((11, 12), None, PROMPT[:8])], 1.0) is Fed.APPLIED
    assert not index.end_replay(A, 7, 1.0)  # it ended at seq 3 (a timeout)
    status = index.status(A)
    # What the engine held before seq 7 is unknown now: nothing of it is credited.
    assert status is not None and status.state is KvState.LIVE and status.blocks == 0
    assert "not replayed" in status.reason
    assert index.feed(A, 7, [stored((11,), None, PROMPT[:4])], 1.0) is Fed.APPLIED
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 1}
    # An engine's very first batch needs no catch-up.
    fresh = live(B)
    fresh.begin_replay(B, 0, 1.0)
    status = fresh.status(B)
    assert status is not None and status.state is KvState.LIVE


def test_a_sequence_that_starts_again_means_the_engine_restarted_and_clears_the_index() -> None:
    index = live(A)
    index.feed(A, 0, [stored((11, 12), None, PROMPT[:8])], 1.0)
    index.feed(A, 1, [stored((13,), 12, PROMPT[8:12])], 1.0)
    assert index.feed(A, 0, [stored((31,), None, PROMPT[:4])], 2.0) is Fed.RESTART
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 1}
    status = index.status(A)
    assert status is not None and status.state is KvState.LIVE and status.next_seq == 1
    assert "restarted" in status.reason
    # Going backwards but not to 0 (a restarted engine whose first batches were missed) too.
    index.feed(A, 1, [], 2.0)
    assert index.feed(A, 1, [], 3.0) is Fed.RESTART


def test_memory_is_bounded_per_backend_oldest_stored_first_out() -> None:
    index = live(A, B, capacity=2)
    index.feed(A, 0, [stored((11, 12, 13), None, PROMPT[:12])], 1.0)
    index.feed(B, 0, [stored((21,), None, PROMPT[:4])], 1.0)
    status = index.status(A)
    assert status is not None and status.blocks == 2
    # Block 0 went first: the prefix is held from nothing on, as far as the index knows.
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 0, B: 1}
    # A block stored again (a prefix-cache hit vLLM reports) becomes the newest.
    index.feed(A, 1, [stored((12,), 11, PROMPT[4:8])], 1.0)
    index.feed(A, 2, [Removed((99,))], 1.0)  # an unknown block's removal changes nothing
    status = index.status(A)
    assert status is not None and status.blocks == 1  # 12 lost its key: its parent went


# -- states --------------------------------------------------------------------------------


def test_only_a_live_index_answers() -> None:
    index = KvIndex()
    index.watch(A, 0.0)
    status = index.status(A)
    assert status is not None and status.state is KvState.LOST  # not connected yet
    assert index.cached([1], BS) == {}
    index.connected(A, 1.0)
    assert index.cached([1], BS) == {A: 0}
    index.feed(A, 0, [stored((11,), None, PROMPT[:4])], 1.0)
    index.lost(A, "disconnected", 2.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {}
    # A reconnection starts afresh: what happened meanwhile is unknown.
    index.connected(A, 3.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 0}
    assert index.feed(B, 0, [], 1.0) is Fed.IGNORED and index.status(B) is None


def test_a_late_connection_event_does_not_reset_a_live_index() -> None:
    index = live(A)
    index.feed(A, 0, [stored((11,), None, PROMPT[:4])], 1.0)
    index.connected(A, 2.0)
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 1}


def test_the_registry_answers_for_live_indexes_and_records_each_state_change() -> None:
    reg = Registry([make_backend("a", "http://h:1", "m"), make_backend("b", "http://h:2", "m")],
                   clock=lambda: 5.0)  # fmt: skip
    reg.kv.watch(A)
    reg.kv.watch(BackendId("nope"))  # not registered: no index
    assert set(reg.kv_status()) == {A}
    reg.kv.connected(A)
    reg.kv.feed(A, 0, [stored((11,), None, PROMPT[:4])])
    assert reg.cached_blocks(block_keys(PROMPT, BS), BS) == {A: 1}
    reg.kv.lost(A, "disconnected from tcp://h:5557")
    assert reg.cached_blocks(block_keys(PROMPT, BS), BS) == {}
    kinds = [(e.data["previous"], e.data["state"]) for e in reg.events.query(EventQuery("kv"))]
    assert kinds == [("off", "lost"), ("lost", "live"), ("live", "lost")]
    last = reg.events.query(EventQuery(EventKind.KV))[-1]
    assert last.backend_id == "a" and last.data["blocks_before"] == 1
    reg.remove("a")
    assert reg.kv_status() == {}


def test_vllm_shaped_payloads_decode_into_index_events() -> None:
    import msgspec

    batch = KVEventBatch(1.0, [BlockStored([b"\x01" * 32], None, list(PROMPT[:4]), BS, None,
                                           "GPU", None, extra_keys=[None])])  # fmt: skip
    events = to_events(decode(msgspec.msgpack.encode(batch)))
    assert events == [Stored((b"\x01" * 32,), None, PROMPT[:4], BS, True)]
    cpu = KVEventBatch(1.0, [BlockStored([1], None, list(PROMPT[:4]), BS, None, "CPU", None)])
    assert to_events(decode(msgspec.msgpack.encode(cpu))) == []
    # A LoRA block is keyed under its adapter's name (tests/unit/test_kv_lora.py); one known
    # by its lora_id alone is not.
    lora = KVEventBatch(1.0, [BlockStored([1], None, list(PROMPT[:4]), BS, 3, "GPU", "ad")])
    assert to_events(decode(msgspec.msgpack.encode(lora)))[0] == Stored(
        (1,), None, PROMPT[:4], BS, True, "ad"
    )
    by_id = KVEventBatch(1.0, [BlockStored([1], None, list(PROMPT[:4]), BS, 3, "GPU", None)])
    (ev,) = to_events(decode(msgspec.msgpack.encode(by_id)))
    assert isinstance(ev, Stored) and not ev.keyable
