"""Soft state as ops (control/fleet/journal.py): what a leader replica's routing did, replayed
on a follower's registry, leaves the follower routing as the leader would: the same pins,
owners, in-flight requests and tenants' windows. Through msgpack, as the stream carries
them."""

from __future__ import annotations

import msgspec

from baton.model import BackendId, PrefixBlocks
from baton.tenancy import Limits, Priority, Tenant
from control.fleet.journal import Op, dump, replay
from control.fleet.registry import Registry
from tests.factories import registry

IDS = ("a", "b", "c")


def _pair() -> tuple[Registry, Registry, list[Op]]:
    leader, follower = registry(IDS), registry(IDS)
    for reg in (leader, follower):
        reg.tenants.replace([Tenant("acme", Priority.STANDARD, 1, Limits(requests_per_minute=3))])
    ops: list[Op] = []
    leader.journal_to(ops.append)
    return leader, follower, ops


def _carried(ops: list[Op]) -> list[Op]:
    """As the Follow stream carries them: msgpack each way."""
    return [msgspec.msgpack.decode(msgspec.msgpack.encode(op)) for op in ops]


def _state(reg: Registry) -> tuple[object, ...]:
    pins = sorted((p.prefix, p.backend_id, p.depth, p.hits) for p in reg.placement.pins)
    sessions = sorted((p.prefix, p.backend_id) for p in reg.placement.sessions)
    owners = sorted((o.key, o.backend_id, o.model) for o in reg.placement.owners)
    return pins, sessions, owners, dict(reg.in_flight())


def test_a_followers_replay_leaves_it_where_the_leader_is() -> None:
    leader, follower, ops = _pair()
    p = leader.placement
    chain = [b"h0", b"h1", b"h2"]
    leader.acquire("r1", BackendId("a"), 1.0)
    p.pin_chain(chain, BackendId("a"), 1.0)
    match = p.longest_pin(chain, 2.0)
    assert match is not None
    p.follow_pin(match, 2.0)
    p.pin_reply(b"h3", BackendId("a"), 4, 2.0)
    p.pin_session("s1", BackendId("b"), 2.0)
    p.record_owner("resp_1", BackendId("c"), "m", 2.0)
    p.record_owner("resp_2", BackendId("c"), "m", 2.0)
    p.release_owner("resp_2")
    p.learn_blocks(PrefixBlocks(b"h2", (1, 2, 3), 2, 16), b"h3", 32)
    leader.acquire("r2", BackendId("b"), 2.0)
    leader.release("r1")
    for op in _carried(ops):
        assert replay(follower, op)
    assert _state(follower) == _state(leader)
    assert follower.placement.implied([b"h3"]) == leader.placement.implied([b"h3"])
    # The follower, now leading, follows the pin the leader made.
    assert follower.placement.longest_pin(chain, 3.0).pin.backend_id == "a"  # type: ignore[union-attr]


def test_a_tenants_window_is_the_same_on_the_follower() -> None:
    leader, follower, ops = _pair()
    for i in range(3):
        assert leader.tenants.admit(f"r{i}", "acme", "m", 10, 1.0).refused is None
        leader.tenants.finished(f"r{i}", 5, 5, 1.5)
    for op in _carried(ops):
        replay(follower, op)
    # A fourth request in the minute is refused on the follower as on the leader: no fresh
    # window because the leader changed.
    assert leader.tenants.admit("r9", "acme", "m", 10, 2.0).refused is not None
    assert follower.tenants.admit("r9", "acme", "m", 10, 2.0).refused is not None
    assert follower.tenants.admit("r9", "acme", "m", 10, 62.0).refused is None


def test_a_late_follower_gets_the_state_from_the_dump() -> None:
    leader, follower, ops = _pair()
    p = leader.placement
    p.pin_chain([b"x0", b"x1"], BackendId("b"), 1.0)
    p.pin_session("s", BackendId("c"), 1.0)
    p.record_owner("resp_9", BackendId("a"), "m", 1.0)
    leader.acquire("r1", BackendId("a"), 1.0)
    for op in _carried(list(dump(leader))):
        assert replay(follower, op)
    assert _state(follower) == _state(leader)


def test_an_op_this_version_does_not_know_is_skipped() -> None:
    _, follower, _ = _pair()
    assert not replay(follower, ("a-later-op", 1, 2))
    assert not replay(follower, ())
