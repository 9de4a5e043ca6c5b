"""Where conversations' state is, as far as routing knows: prefix pins (the backend whose
KV cache holds a message prefix, control/fleet/pins.py), explicit sessions (a client's session
id), ownership pins (which backend stores a Responses API response, control/fleet/owners.py) and
which KV blocks a message prefix implies (control/fleet/chainblocks.py). The registry owns one;
the router reads and updates it. Pins are hints a policy may overrule; ownership pins are facts."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from baton.model import BackendId, PrefixBlocks
from control.fleet.chainblocks import ChainBlocks, Implied
from control.fleet.owners import Owned, OwnerTable
from control.fleet.pins import Pin, PinMatch, PinTable, PinView


class Placement:
    def __init__(
        self,
        pins: PinTable | None = None,
        sessions: PinTable | None = None,
        owners: OwnerTable | None = None,
    ) -> None:
        self._pins = pins if pins is not None else PinTable()
        self._sessions = sessions if sessions is not None else PinTable()
        self._owners = owners if owners is not None else OwnerTable()
        self._chains = ChainBlocks()
        # While a leader replica has followers: each change as an op (control/fleet/journal.py),
        # replayed on their tables so a new leader's pins are warm.
        self.journal: Callable[[tuple[object, ...]], None] | None = None

    # -- prefix pins: where each prefix's KV cache is ---------------------------------------

    @property
    def pins(self) -> PinView:
        return self._pins

    def longest_pin(self, chain: Sequence[bytes], now: float) -> PinMatch | None:
        return self._pins.longest(chain, now)

    def follow_pin(self, match: PinMatch, now: float) -> None:
        """A request went where its pin pointed: the pin stays warm."""
        if self.journal is not None:
            self.journal(("follow", match.pin.prefix, now))
        self._pins.touch(match, now)

    def pin_chain(self, chain: Sequence[bytes], backend_id: BackendId, now: float) -> None:
        if self.journal is not None:
            self.journal(("chain", list(chain), backend_id, now))
        self._pins.pin_chain(chain, backend_id, now)

    def pin_reply(self, prefix: bytes, backend_id: BackendId, depth: int, now: float) -> None:
        if self.journal is not None:
            self.journal(("reply", prefix, backend_id, depth, now))
        self._pins.pin(prefix, backend_id, depth, now)

    def clear_pins(self, backend_id: str = "") -> int:
        """Drop one backend's pins, or (no id) all of them; how many went."""
        if self.journal is not None:
            self.journal(("clear", backend_id))
        return self._pins.drop_backend(backend_id) if backend_id else self._pins.clear()

    def expire_pins(self, now: float) -> int:
        return self._pins.expire(now)

    def restore(self, pin: Pin, session: bool = False) -> None:
        """A pin (or session) as a leader replica holds it (control/fleet/journal.py)."""
        (self._sessions if session else self._pins).restore(pin)

    # -- sessions: a client's explicit conversation key -------------------------------------

    @property
    def sessions(self) -> PinView:
        return self._sessions

    def session_pin(self, session: str, now: float) -> PinMatch | None:
        return self._sessions.longest((session.encode(),), now)

    def pin_session(self, session: str, backend_id: BackendId, now: float) -> None:
        if self.journal is not None:
            self.journal(("session", session, backend_id, now))
        self._sessions.pin(session.encode(), backend_id, 0, now)

    # -- ownership: which backend holds a stored response (control/fleet/owners.py) ---------

    @property
    def owners(self) -> Iterable[Owned]:
        return iter(self._owners)

    @property
    def owner_count(self) -> int:
        return len(self._owners)

    def record_owner(self, key: str, backend_id: BackendId, model: str, now: float) -> None:
        if self.journal is not None:
            self.journal(("own", key, backend_id, model, now))
        self._owners.record(key, backend_id, model, now)

    def release_owner(self, key: str) -> bool:
        if self.journal is not None:
            self.journal(("disown", key))
        return self._owners.release(key)

    def owner_of(self, key: str, now: float) -> Owned | None:
        return self._owners.owner(key, now)

    # -- which KV blocks a message prefix implies (control/fleet/chainblocks.py) ------------

    def learn_blocks(self, blocks: PrefixBlocks, reply_chain_hash: bytes, tokens: int) -> None:
        if self.journal is not None:
            self.journal(("learn", blocks.prompt_chain_hash, list(blocks.keys),
                          blocks.prompt_blocks, blocks.block_size, reply_chain_hash, tokens))
        self._chains.learn(blocks, reply_chain_hash, tokens)

    def implied(self, chain: Sequence[bytes]) -> tuple[int, Implied] | None:
        return self._chains.longest(chain)
