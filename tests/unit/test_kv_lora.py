"""KV-event routing per LoRA adapter (issue 42), control's side: Baton's block keys have a root
per adapter (baton.blocks.root), vLLM's BlockStored under an adapter (lora_name, extra keys
`(lora_name,)`) is indexed under that root instead of being set aside, and the index answers
for an adapter's blocks only to that adapter's keys, never to the base's or another's."""

from __future__ import annotations

from array import array

import msgspec
import pytest

from baton.blocks import ROOT, block_key, block_keys, root
from baton.model import BackendId, RequestShape
from control.signals.kv.index import KvIndex, Removed, Stored
from control.signals.kv.wire import BlockStored, KVEventBatch, decode, to_events
from dataplane.relay.prefixblocks import prefix_blocks
from dataplane.relay.progress import ChoiceProgress
from sim import kv_wire

A, B = BackendId("a"), BackendId("b")
BS = 4
PROMPT = tuple(range(100, 114))  # 3 full blocks of 4 and 2 tokens over


def live(*backends: BackendId) -> KvIndex:
    index = KvIndex(1000)
    for bid in backends:
        index.watch(bid, 0.0)
        index.connected(bid, 0.0)
    return index


def wire(*events: kv_wire.BlockStored) -> list[Stored]:
    """Events as the sim (vLLM 0.32's layout) publishes them, as control decodes them."""
    out = to_events(decode(msgspec.msgpack.encode(kv_wire.KVEventBatch(1.0, list(events), 0))))
    assert all(isinstance(ev, Stored) for ev in out)
    return out  # type: ignore[return-value]


def lora_stored(hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...],
                name: str, lora_id: int = 1) -> kv_wire.BlockStored:  # fmt: skip
    return kv_wire.stored(hashes, parent, list(tokens), BS, (lora_id, name))


# -- roots ---------------------------------------------------------------------------------


def test_each_adapter_has_a_root_of_its_own_and_the_base_keeps_root() -> None:
    assert root(None) == root("") == ROOT
    assert block_keys(PROMPT, BS, root(None)) == block_keys(PROMPT, BS)  # the base: as before
    ra, rb = root("sql-lora"), root("chat-lora")
    assert len({ROOT, ra, rb}) == 3 and all(0 <= r < 2**64 for r in (ra, rb))
    assert root("sql-lora") == ra  # stable: a pure function of the name (no seed)
    base, a, b = (block_keys(PROMPT, BS, r) for r in (ROOT, ra, rb))
    assert not set(base) & set(a) and not set(a) & set(b) and not set(base) & set(b)
    # Past the root it is the same chain: an adapter's block i continues from block i-1.
    assert a[1] == block_key(a[0], PROMPT[4:8])


# -- the wire: which LoRA events are keyable ------------------------------------------------


def test_a_lora_block_stored_is_keyable_under_its_adapter_name() -> None:
    (ev,) = wire(lora_stored((11, 12), None, PROMPT[:8], "sql-lora", 3))
    assert ev.keyable and ev.adapter == "sql-lora"
    (base,) = wire(kv_wire.stored((11,), None, list(PROMPT[:4]), BS))
    assert base.keyable and base.adapter is None


@pytest.mark.parametrize(
    ("lora_id", "lora_name", "extra"),
    [
        (3, "sql-lora", [("sql-lora", ("mm-hash", 0))]),  # multimodal input under an adapter
        (3, "sql-lora", [("sql-lora", "salt")]),  # a cache salt under an adapter
        (3, "sql-lora", [("other-lora",)]),  # extra keys that do not name its adapter
        (3, None, [None]),  # an adapter known by its per-engine id only (vLLM before lora_name)
        (None, None, [("salt",)]),  # the base model's salted block: set aside, as before
    ],
)
def test_blocks_with_more_than_tokens_and_adapter_stay_set_aside(
    lora_id: int | None, lora_name: str | None, extra: list[tuple[object, ...] | None]
) -> None:
    ev = BlockStored([11], None, list(PROMPT[:4]), BS, lora_id, "GPU", lora_name,
                     extra_keys=extra)  # fmt: skip
    (out,) = to_events(decode(msgspec.msgpack.encode(KVEventBatch(1.0, [ev]))))
    assert isinstance(out, Stored) and not out.keyable
    index = live(A)
    index.feed(A, 0, [out], 1.0)
    for r in (ROOT, root("sql-lora"), root("other-lora")):
        assert index.cached(block_keys(PROMPT, BS, r), BS) == {A: 0}


# -- the index ---------------------------------------------------------------------------


def test_an_adapters_blocks_answer_only_to_that_adapters_keys() -> None:
    index = live(A, B)
    # The same tokens: under adapter "x" on A, on the base model on B.
    index.feed(A, 0, wire(lora_stored((11, 12, 13), None, PROMPT[:12], "x")), 1.0)
    index.feed(B, 0, wire(kv_wire.stored((21, 22, 23), None, list(PROMPT[:12]), BS)), 1.0)
    assert index.cached(block_keys(PROMPT, BS, root("x")), BS) == {A: 3, B: 0}
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 0, B: 3}
    assert index.cached(block_keys(PROMPT, BS, root("y")), BS) == {A: 0, B: 0}
    status = index.status(A)
    assert status is not None and status.blocks == 3  # LoRA blocks are held with keys now


def test_a_child_event_continues_its_parents_adapter_chain() -> None:
    """Only a chain's first block starts at the adapter's root: blocks stored later with a
    parent hash are keyed from the parent's key (vLLM sends a growing sequence's blocks in
    several events)."""
    index = live(A)
    index.feed(A, 0, wire(lora_stored((11,), None, PROMPT[:4], "x")), 1.0)
    index.feed(A, 1, wire(lora_stored((12, 13), 11, PROMPT[4:12], "x")), 1.0)
    keys = block_keys(PROMPT, BS, root("x"))
    assert index.cached(keys, BS) == {A: 3}
    # Not the keys of blocks 1..2 as if they started a chain at the root.
    assert index.cached(block_keys(PROMPT[4:12], BS, root("x")), BS) == {A: 0}
    index.feed(A, 2, [Removed((12,))], 1.0)  # removal works by engine hash, as for the base
    assert index.cached(keys, BS) == {A: 1}


def test_two_adapters_on_one_engine_are_told_apart() -> None:
    index = live(A)
    index.feed(A, 0, wire(lora_stored((11, 12), None, PROMPT[:8], "x", 1),
                          lora_stored((31, 32, 33), None, PROMPT[:12], "y", 2)), 1.0)  # fmt: skip
    assert index.cached(block_keys(PROMPT, BS, root("x")), BS) == {A: 2}
    assert index.cached(block_keys(PROMPT, BS, root("y")), BS) == {A: 3}
    assert index.cached(block_keys(PROMPT, BS), BS) == {A: 0}


# -- where the shim and the index meet ------------------------------------------------------


def test_the_blocks_a_shim_reports_for_an_adapter_are_the_ones_the_index_holds_for_it() -> None:
    shape = RequestShape(model="x", prefix_chain=(b"\x01" * 16,))
    choice = ChoiceProgress(0, array("I", PROMPT[:8]))
    choice.add("out", list(PROMPT[8:12]))
    lora = prefix_blocks(shape, BS, choice, "x")
    base = prefix_blocks(shape, BS, choice)
    assert lora is not None and base is not None
    assert base.keys == tuple(block_keys(PROMPT[:12], BS))  # the base: as before
    assert lora.keys == tuple(block_keys(PROMPT[:12], BS, root("x")))
    assert lora.prompt_blocks == base.prompt_blocks == 2
    index = live(A)
    index.feed(A, 0, wire(lora_stored((11, 12, 13), None, PROMPT[:12], "x")), 1.0)
    assert index.cached(lora.keys, BS) == {A: 3}
    assert index.cached(base.keys, BS) == {A: 0}
    other = prefix_blocks(shape, BS, choice, "y")
    assert other is not None and index.cached(other.keys, BS) == {A: 0}
