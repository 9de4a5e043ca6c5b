"""Per backend, the prefix blocks its engine really holds, built from the engine's KV-cache
events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, decoded by control/signals/kv/wire.py)
and keyed by Baton's own block keys (baton/blocks.py), so a request's prefix can be looked up by
keys the shim computes from its prompt ids.

Soundness is the rule: every key an index answers for is held by the engine. Any unbroken run
of an engine's batches, from whatever sequence number it starts, keeps that true (a block we
saw stored and did not see removed is still there); a missing batch breaks it (a removal may
be in it). So each backend tracks the next sequence number it expects:

- a batch past it is a gap, reported to the caller, who replays the missed batches from the
  engine (state `replaying`) or, when that fails, marks the index `lost`;
- a batch before it means the engine restarted (vLLM counts from 0 again): the index is
  cleared, unless it is a batch a replay has already delivered;
- `lost` (the stream is gone, or a replay failed) clears the index; the next batch starts a
  fresh one, and a new connection does too.

Only a `live` index answers queries: a dead one never silently steers a request. A block
stored under a LoRA adapter is keyed from that adapter's root (baton.blocks.root), as the
shim keys a request for it, so one adapter's (or the base's) blocks never answer for
another's. Blocks the index cannot key (a parent it does not know, multimodal or salted
blocks, whose content is more than their token ids and adapter) are recorded without a key,
so their removal and their children are recognised; nothing is guessed. Memory is bounded
per backend: beyond `capacity` blocks, the oldest stored goes first. Time comes in as
`now`."""

# baton: pure

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from baton.blocks import block_keys, root
from baton.model import BackendId

EngineHash = bytes | int  # vLLM's ExternalBlockHash


class KvState(StrEnum):
    OFF = "off"  # no KV events configured for the backend
    LIVE = "live"
    REPLAYING = "replaying"
    LOST = "lost"


class Fed(StrEnum):
    """What a batch did."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already delivered by a replay
    GAP = "gap"  # batches are missing before it: replay from `next_seq`, then feed it again
    RESTART = "restart"  # the engine counts from the start again: index cleared, then applied
    IGNORED = "ignored"  # no index for that backend


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    keyable: bool = True  # False: the blocks' content is more than their token ids (and adapter)
    adapter: str | None = None  # the LoRA adapter they were computed under (its lora_name)


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[EngineHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class KvStatus:
    state: KvState
    reason: str
    since: float
    blocks: int = 0  # blocks held with a Baton key
    next_seq: int | None = None  # the batch expected next; None: none seen yet
    block_size: int = 0  # the engine's, from its BlockStored events; 0: not seen yet
    events: Mapping[str, int] = field(default_factory=dict)  # applied, by kind


Changed = Callable[[BackendId, KvStatus, KvStatus], None]  # (backend, before, after)


class _Blocks:
    """One engine's blocks: engine hash -> Baton key (None: not keyable), oldest first."""

    def __init__(self) -> None:
        self.by_hash: OrderedDict[EngineHash, int | None] = OrderedDict()
        self.held: Counter[int] = Counter()  # Baton key -> engine blocks with it
        self.block_size = 0

    def store(self, ev: Stored, capacity: int) -> None:
        keys = self._keys(ev)
        for h, key in zip(ev.hashes, keys, strict=True):
            self._drop(h)
            self.by_hash[h] = key
            if key is not None:
                self.held[key] += 1
        while len(self.by_hash) > capacity:
            self._drop(next(iter(self.by_hash)))

    def _keys(self, ev: Stored) -> Sequence[int | None]:
        unknown: list[int | None] = [None] * len(ev.hashes)
        if not ev.keyable or ev.block_size <= 0:
            return unknown
        # Only a chain's first block starts at its adapter's root: a child continues its
        # parent's key, which already has the adapter in it.
        parent = root(ev.adapter) if ev.parent is None else self.by_hash.get(ev.parent)
        if parent is None or len(ev.token_ids) != ev.block_size * len(ev.hashes):
            return unknown
        if self.block_size and ev.block_size != self.block_size:
            return unknown  # another group's or a partial block: not comparable
        self.block_size = ev.block_size
        return block_keys(ev.token_ids, ev.block_size, parent)

    def remove(self, hashes: Iterable[EngineHash]) -> None:
        for h in hashes:
            self._drop(h)

    def _drop(self, h: EngineHash) -> None:
        key = self.by_hash.pop(h, None)
        if key is not None:
            self.held[key] -= 1
            if self.held[key] <= 0:
                del self.held[key]

    def leading(self, keys: Sequence[int]) -> int:
        n = 0
        for key in keys:
            if key not in self.held:
                break
            n += 1
        return n


class _Backend:
    def __init__(self, now: float) -> None:
        self.status = KvStatus(KvState.LOST, "not connected yet", now)
        self.blocks = _Blocks()
        self.next_seq: int | None = None
        self.replay_from: int | None = None  # a replay began here: earlier seqs are restarts
        self.catching_up = False  # replaying what came before the first batch control saw
        self.first_seq: int | None = None  # the first batch this index applied
        self.events: Counter[str] = Counter()


class KvIndex:
    def __init__(self, capacity: int = 1_000_000, on_change: Changed | None = None) -> None:
        self._capacity = capacity
        self._on_change = on_change
        self._b: dict[BackendId, _Backend] = {}

    # -- which backends have an index ------------------------------------------------------

    def watch(self, backend_id: BackendId, now: float) -> None:
        """The backend's events are subscribed to; it is `lost` until connected."""
        if backend_id not in self._b:
            self._b[backend_id] = b = _Backend(now)
            self._changed(backend_id, KvStatus(KvState.OFF, "", now), b.status)

    def forget(self, backend_id: BackendId) -> None:
        self._b.pop(backend_id, None)

    # -- the stream --------------------------------------------------------------------------

    def connected(self, backend_id: BackendId, now: float) -> None:
        """A (re)connection: whatever it missed meanwhile is unknown, so a lost index starts
        afresh. One already live or replaying has had batches on this connection (a disconnect
        comes first, on the same monitor): its handshake event came late, not again."""
        b = self._b.get(backend_id)
        if b is not None and b.status.state is KvState.LOST:
            self._reset(b)
            self._set(backend_id, KvState.LIVE, "connected", now)

    def lost(self, backend_id: BackendId, reason: str, now: float) -> None:
        if (b := self._b.get(backend_id)) is not None:
            self._reset(b)
            self._set(backend_id, KvState.LOST, reason, now)

    def begin_replay(self, backend_id: BackendId, seq: int, now: float) -> None:
        """A gap before batch `seq`: the missed batches are being asked for. On an index that
        has seen no batch yet, a catch-up: the engine published `seq` batches before control
        subscribed (it ran before control started, or while control was cut off), and what
        it cached then is asked for from the start of its buffer."""
        b = self._b.get(backend_id)
        if b is None:
            return
        if b.next_seq is not None:
            b.replay_from = b.next_seq
            self._set(backend_id, KvState.REPLAYING, f"gap: seq {b.next_seq}..{seq - 1} missed",
                      now)  # fmt: skip
        elif seq > 0:
            b.replay_from, b.catching_up = 0, True
            self._set(backend_id, KvState.REPLAYING, f"catching up: seq 0..{seq - 1} came "
                      "before control subscribed", now)  # fmt: skip

    def end_replay(self, backend_id: BackendId, reached: int, now: float) -> bool:
        """The replay ended; it succeeded when it delivered every batch before `reached`
        (the one that showed the gap). Otherwise the index is lost; a catch-up that fell
        short starts afresh from `reached` instead (as without one: what the engine cached
        before is unknown, so never credited)."""
        b = self._b.get(backend_id)
        if b is None or b.status.state is not KvState.REPLAYING:
            return False
        catching_up, b.catching_up = b.catching_up, False
        if b.next_seq is not None and b.next_seq >= reached:
            first = f"caught up from seq {b.first_seq}" if catching_up else (
                f"replayed from seq {b.replay_from}")  # fmt: skip
            self._set(backend_id, KvState.LIVE, first, now)
            return True
        if catching_up:
            self._reset(b)
            self._set(backend_id, KvState.LIVE, f"events from seq {reached} (the earlier ones "
                      f"were not replayed)", now)  # fmt: skip
            return False
        self.lost(backend_id, f"replay did not reach seq {reached} (at {b.next_seq})", now)
        return False

    def feed(self, backend_id: BackendId, seq: int, events: Sequence[KvEvent], now: float) -> Fed:
        b = self._b.get(backend_id)
        if b is None:
            return Fed.IGNORED
        if b.status.state is KvState.LOST:
            self._reset(b)
            self._set(backend_id, KvState.LIVE, f"events from seq {seq}", now)
        verdict = Fed.APPLIED
        if b.next_seq is not None and seq != b.next_seq:
            if seq > b.next_seq:
                return Fed.GAP
            if b.replay_from is not None and seq >= b.replay_from:
                return Fed.DUPLICATE
            if b.status.state is KvState.REPLAYING:
                return Fed.GAP  # a replay that goes backwards is not the run we asked for
            before = b.next_seq
            self._reset(b)
            self._set(backend_id, KvState.LIVE, f"engine restarted (seq {seq}, expected "
                      f"{before})", now, force=True)  # fmt: skip
            verdict = Fed.RESTART
        self._apply(b, events)
        if b.next_seq is None:
            b.first_seq = seq
        b.next_seq = seq + 1
        if b.status.state is KvState.LIVE:
            b.replay_from = None  # live batches come in order: no replayed one is still due
        self._refresh(backend_id)
        return verdict

    def _apply(self, b: _Backend, events: Sequence[KvEvent]) -> None:
        for ev in events:
            if isinstance(ev, Stored):
                b.blocks.store(ev, self._capacity)
                b.events["stored"] += 1
            elif isinstance(ev, Removed):
                b.blocks.remove(ev.hashes)
                b.events["removed"] += 1
            else:
                b.blocks = _Blocks()
                b.events["cleared"] += 1

    # -- reads -------------------------------------------------------------------------------

    def status(self, backend_id: BackendId) -> KvStatus | None:
        b = self._b.get(backend_id)
        return None if b is None else b.status

    def statuses(self) -> Mapping[BackendId, KvStatus]:
        return {bid: b.status for bid, b in sorted(self._b.items())}

    def cached(self, keys: Sequence[int], block_size: int) -> dict[BackendId, int]:
        """For each backend whose index is live and whose engine's block size is
        `block_size` (or not known yet: it holds nothing keyed), how many of `keys`' leading
        blocks it holds. Backends not live are absent: not trusted, not zero."""
        return {
            bid: b.blocks.leading(keys)
            for bid, b in self._b.items()
            if b.status.state is KvState.LIVE and b.blocks.block_size in (0, block_size)
        }

    # -- internals ---------------------------------------------------------------------------

    def _reset(self, b: _Backend) -> None:
        b.blocks = _Blocks()
        b.next_seq = b.first_seq = None
        b.replay_from = None
        b.catching_up = False

    def _set(self, bid: BackendId, state: KvState, reason: str, now: float, *,
             force: bool = False) -> None:  # fmt: skip
        b = self._b[bid]
        before = b.status
        b.status = self._snapshot(b, replace(before, state=state, reason=reason, since=now))
        if force or state is not before.state:
            self._changed(bid, before, b.status)

    def _refresh(self, bid: BackendId) -> None:
        b = self._b[bid]
        b.status = self._snapshot(b, b.status)

    def _snapshot(self, b: _Backend, s: KvStatus) -> KvStatus:
        return replace(s, blocks=len(b.blocks.held), next_seq=b.next_seq,
                       block_size=b.blocks.block_size, events=dict(b.events))  # fmt: skip

    def _changed(self, bid: BackendId, before: KvStatus, after: KvStatus) -> None:
        if self._on_change is not None:
            self._on_change(bid, before, after)
