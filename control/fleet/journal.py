"""Soft state as operations: what a leader replica's registry did to its in-flight requests,
pins, sessions, stored responses' owners and tenants' use, replayed in order on a follower's
own tables (control/replicas/follow.py carries them). Replaying the operations, not shipping
the tables, keeps each change a few dozen bytes, and a follower's tenants' windows, charged
and corrected exactly as the leader's were, hold the same requests and tokens.

An op is a tuple of plain values (msgpack on the wire): its name, then the arguments of the
registry call it records (control/fleet/placement.py, tenants.py, registry.py make them)."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from baton.budgets import SpendRow
from baton.model import BackendId, PrefixBlocks
from control.fleet.pins import Pin, PinMatch
from control.fleet.registry import Registry

Op = Sequence[Any]


def _follow(r: Registry, prefix: bytes, now: float) -> None:
    match = r.placement.longest_pin((prefix,), now)
    if match is not None and match.index == 0:
        r.placement.follow_pin(PinMatch(match.pin, 0), now)


def _learn(
    r: Registry,
    chain_hash: bytes,
    keys: list[int],
    prompt_blocks: int,
    block_size: int,
    reply_hash: bytes,
    tokens: int,
) -> None:
    blocks = PrefixBlocks(chain_hash, tuple(keys), prompt_blocks, block_size)
    r.placement.learn_blocks(blocks, reply_hash, tokens)


def _pin(
    r: Registry,
    session: bool,
    prefix: bytes,
    bid: str,
    depth: int,
    created: float,
    last_used: float,
    hits: int,
) -> None:
    r.placement.restore(Pin(prefix, BackendId(bid), depth, created, last_used, hits), session)


def _spend(
    r: Registry, tenant: str, key: str, start: int, end: int, spent: str, notified: list[str]
) -> None:
    row = SpendRow(tenant, key, start, end, int(spent), tuple(int(n) for n in notified))
    r.tenants.spend.restore((row,), 0.0)  # every row the leader holds (0: none is "over")


_FINISHED = ("model", "cached_tokens", "tenant_id", "served")  # finished()'s keywords, in order

_REPLAY: dict[str, Callable[..., Any]] = {
    "acquire": lambda r, rid, bid, now: r.acquire(rid, BackendId(bid), now),
    "release": lambda r, rid: r.release(rid),
    "follow": _follow,
    "chain": lambda r, chain, bid, now: r.placement.pin_chain(chain, BackendId(bid), now),
    "reply": lambda r, p, bid, depth, now: r.placement.pin_reply(p, BackendId(bid), depth, now),
    "clear": lambda r, bid: r.placement.clear_pins(bid),
    "session": lambda r, s, bid, now: r.placement.pin_session(s, BackendId(bid), now),
    "own": lambda r, key, bid, model, now: r.placement.record_owner(
        key, BackendId(bid), model, now
    ),
    "disown": lambda r, key: r.placement.release_owner(key),
    "learn": _learn,
    # An older leader's ops lack the later arguments (budgets': output tokens, model, cached
    # tokens, tenant, served): their defaults stand.
    "admit": lambda r, rid, tenant, model, tokens, now, *rest: r.tenants.admit(
        rid, tenant, model, tokens, now, *rest
    ),
    "cancel": lambda r, rid: r.tenants.cancel(rid),
    "finished": lambda r, rid, p, c, now, refused, *rest: r.tenants.finished(
        rid, p, c, now, refused, **dict(zip(_FINISHED, rest, strict=False))
    ),
    "waited": lambda r, tenant, s, shed, now: r.tenants.waited(tenant, s, shed, now),
    "spend": _spend,
    "pin": lambda r, *args: _pin(r, False, *args),
    "session-pin": lambda r, *args: _pin(r, True, *args),
}


def replay(registry: Registry, op: Op) -> bool:
    """Applies one op (False: an op this version does not know, skipped)."""
    apply = _REPLAY.get(op[0]) if op else None
    if apply is None:
        return False
    apply(registry, *op[1:])
    return True


def dump(registry: Registry) -> Iterator[Op]:
    """The soft state now, as ops that rebuild it on an empty follower: pins and sessions
    with their times, owners, in-flight requests, tenants' spend per period (amounts as
    decimal text: msgpack's integers stop at 64 bits). Tenants' windows are not dumped: a
    follower that joins late has them exact a window (a minute) later."""
    placement = registry.placement
    for pin in placement.pins:
        yield ("pin", pin.prefix, pin.backend_id, pin.depth, pin.created, pin.last_used, pin.hits)
    for pin in placement.sessions:
        yield (
            "session-pin",
            pin.prefix,
            pin.backend_id,
            pin.depth,
            pin.created,
            pin.last_used,
            pin.hits,
        )
    for owned in placement.owners:
        yield ("own", owned.key, owned.backend_id, owned.model, owned.last_used)
    for rid, bid, since in registry.held():
        yield ("acquire", rid, bid, since)
    for row in registry.tenants.spend.rows():
        yield ("spend", row.tenant_id, row.key, row.start, row.end, str(row.spent),
               [str(n) for n in row.notified])  # fmt: skip
