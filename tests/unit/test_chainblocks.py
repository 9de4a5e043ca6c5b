"""Which KV blocks a message prefix implies (control/fleet/chainblocks.py), learned from the
shims' reports, and what the registry answers from it with the KV index."""

from __future__ import annotations

from baton.blocks import block_keys
from baton.model import PrefixBlocks, RequestShape
from control.fleet.chainblocks import ChainBlocks

PROMPT = list(range(100, 140))  # 40 tokens: 5 blocks of 8
REPLY = list(range(500, 520))  # 20 more: the reply completes 2 blocks more (60 // 8 = 7)


def report() -> PrefixBlocks:
    keys = block_keys(PROMPT + REPLY, 8)
    return PrefixBlocks(b"p2", tuple(keys), len(PROMPT) // 8, 8)


def test_the_prompt_implies_its_blocks_and_the_reply_hash_the_whole_conversation() -> None:
    t = ChainBlocks()
    t.learn(report(), b"r3", len(PROMPT))
    i, prompt = t.longest((b"p1", b"p2"))  # type: ignore[misc]
    assert i == 1 and prompt.keys == tuple(block_keys(PROMPT, 8)) and prompt.tokens == 40
    # The next turn: the prompt, the reply, a new message. Its longest known prefix is the
    # reply's hash, which implies the prompt's blocks and the reply's.
    i, turn = t.longest((b"p1", b"p2", b"r3", b"new"))  # type: ignore[misc]
    assert i == 2 and len(turn.keys) == 7 and turn.keys[:5] == prompt.keys and turn.tokens == 0
    assert t.longest((b"other",)) is None  # never seen: implies nothing


def test_bounded_least_recently_used_first_out() -> None:
    t = ChainBlocks(capacity=2)
    t.learn(report(), b"r3", 40)  # two entries: p2 and r3
    assert t.longest((b"p2",)) is not None  # p2 is now the most recent
    t.learn(PrefixBlocks(b"q", (1, 2), 2, 8), b"", 16)
    assert len(t) == 2 and t.longest((b"r3",)) is None and t.longest((b"q",)) is not None


def test_the_registry_credits_only_backends_whose_live_index_holds_the_blocks() -> None:
    from baton.model import BackendId
    from control.signals.kv.index import Stored
    from tests.factories import registry

    reg = registry("ab")
    reg.placement.learn_blocks(report(), b"r3", 40)
    shape = RequestShape("m", message_count=4, prefix_chain=(b"p1", b"p2", b"r3", b"new"))
    assert reg.cached_tokens(shape) == ({}, None)  # no live index anywhere: nothing trusted
    for b in (BackendId("a"), BackendId("b")):
        reg.kv.watch(b)
        reg.kv.connected(b)
    stored = Stored(hashes=tuple(range(1, 6)), parent=None, token_ids=tuple(PROMPT), block_size=8)
    reg.kv.feed(BackendId("a"), 0, [stored])
    cached, exact = reg.cached_tokens(shape)
    assert cached == {BackendId("a"): 40, BackendId("b"): 0} and exact is None
    first = RequestShape("m", message_count=2, prefix_chain=(b"p1", b"p2"))
    cached, exact = reg.cached_tokens(first)
    assert cached[BackendId("a")] == 40 and exact == 40
