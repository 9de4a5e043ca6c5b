"""Where conversations' state is, as far as routing knows: prefix pins (the backend whose
KV cache holds a message prefix, control/fleet/pins.py), explicit sessions (a client's session
id), ownership pins (which backend stores a Responses API response, control/fleet/owners.py) and
which KV blocks a message prefix implies (control/fleet/chainblocks.py). The registry owns one;
the router reads and updates it. Pins are hints a policy may overrule; ownership pins are facts."""

# baton: pure

from __future__ import annotations

from collections.abc import Iterable, Sequence

from baton.model import BackendId, PrefixBlocks
from control.fleet.chainblocks import ChainBlocks, Implied
from control.fleet.owners import Owned, OwnerTable
from control.fleet.pins import PinMatch, PinTable, PinView


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

    # -- prefix pins: where each prefix's KV cache is ---------------------------------------

    @property
    def pins(self) -> PinView:
        return self._pins

    def longest_pin(self, chain: Sequence[bytes], now: float) -> PinMatch | None:
        return self._pins.longest(chain, now)

    def follow_pin(self, match: PinMatch, now: float) -> None:
        """A request went where its pin pointed: the pin stays warm."""
        self._pins.touch(match, now)

    def pin_chain(self, chain: Sequence[bytes], backend_id: BackendId, now: float) -> None:
        self._pins.pin_chain(chain, backend_id, now)

    def pin_reply(self, prefix: bytes, backend_id: BackendId, depth: int, now: float) -> None:
        self._pins.pin(prefix, backend_id, depth, now)

    def clear_pins(self, backend_id: str = "") -> int:
        """Drop one backend's pins, or (no id) all of them; how many went."""
        return self._pins.drop_backend(backend_id) if backend_id else self._pins.clear()

    def expire_pins(self, now: float) -> int:
        return self._pins.expire(now)

    # -- sessions: a client's explicit conversation key -------------------------------------

    @property
    def sessions(self) -> PinView:
        return self._sessions

    def session_pin(self, session: str, now: float) -> PinMatch | None:
        return self._sessions.longest((session.encode(),), now)

    def pin_session(self, session: str, backend_id: BackendId, now: float) -> None:
        self._sessions.pin(session.encode(), backend_id, 0, now)

    # -- ownership: which backend holds a stored response (control/fleet/owners.py) ---------

    @property
    def owners(self) -> Iterable[Owned]:
        return iter(self._owners)

    @property
    def owner_count(self) -> int:
        return len(self._owners)

    def record_owner(self, key: str, backend_id: BackendId, model: str, now: float) -> None:
        self._owners.record(key, backend_id, model, now)

    def release_owner(self, key: str) -> bool:
        return self._owners.release(key)

    def owner_of(self, key: str, now: float) -> Owned | None:
        return self._owners.owner(key, now)

    # -- which KV blocks a message prefix implies (control/fleet/chainblocks.py) ------------

    def learn_blocks(self, blocks: PrefixBlocks, reply_chain_hash: bytes, tokens: int) -> None:
        self._chains.learn(blocks, reply_chain_hash, tokens)

    def implied(self, chain: Sequence[bytes]) -> tuple[int, Implied] | None:
        return self._chains.longest(chain)
