"""What control/fleet/kv_subscribers.py's subscribers tell a registry's KV index
(control/signals/kv/index.py): a stream watched, connected, lost, a batch fed, a replay begun and
ended, each on the registry's clock. Only a registered backend gets an index; a batch that announces
a new block size has the registry publish a snapshot, since shims report a prefix's blocks in that
size."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable, Sequence

from baton.model import BackendId
from control.signals.kv.index import Fed, KvEvent, KvIndex


class KvFeed:
    def __init__(
        self,
        index: KvIndex,
        clock: Callable[[], float],
        known: Callable[[BackendId], bool],
        publish: Callable[[], None],
    ) -> None:
        self._index = index
        self._clock = clock
        self._known = known
        self._publish = publish

    def watch(self, backend_id: BackendId) -> None:
        if self._known(backend_id):
            self._index.watch(backend_id, self._clock())

    def forget(self, backend_id: BackendId) -> None:
        self._index.forget(backend_id)

    def connected(self, backend_id: BackendId) -> None:
        self._index.connected(backend_id, self._clock())

    def lost(self, backend_id: BackendId, reason: str) -> None:
        self._index.lost(backend_id, reason, self._clock())

    def feed(self, backend_id: BackendId, seq: int, events: Sequence[KvEvent]) -> Fed:
        before = self._index.status(backend_id)
        fed = self._index.feed(backend_id, seq, events, self._clock())
        after = self._index.status(backend_id)
        if after is not None and after.block_size != (before.block_size if before else 0):
            self._publish()
        return fed

    def begin_replay(self, backend_id: BackendId, seq: int) -> None:
        self._index.begin_replay(backend_id, seq, self._clock())

    def end_replay(self, backend_id: BackendId, reached: int) -> bool:
        return self._index.end_replay(backend_id, reached, self._clock())
