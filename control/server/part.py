"""A replica's part as control/api/leader_gate.py and the routing service ask it, and its
events' sink: the null standalone part (a control that is no replica, or one that has not
joined its group yet), or a joined replica's (control/replicas/replica.py)."""

# baton: pure

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from control.api.leader_gate import Replica as Leadership
from control.api.leader_gate import Standalone
from control.audit.log import Entry
from control.replicas.replica import Replica


class Part(Leadership, Protocol):
    def record(self, entry: Entry) -> None:
        """An audit event, for the store (a replica's events are kept in etcd)."""
        ...


class Alone(Standalone):
    """Always leads; its events stay in its own log."""

    def record(self, entry: Entry) -> None:
        return None


ALONE = Alone()


class Joined:
    """The part of a replica that joined its group."""

    def __init__(self, replica: Replica, clock: Callable[[], float]) -> None:
        self._replica = replica
        self._clock = clock

    @property
    def leading(self) -> bool:
        return self._replica.leading

    def refusal(self) -> tuple[str, str]:
        return self._replica.refusal()

    async def sync(self) -> None:
        await self._replica.sync()

    async def own(self, key: str, backend_id: str, model: str, released: bool) -> None:
        await self._replica.own(key, backend_id, model, self._clock(), released)

    def record(self, entry: Entry) -> None:
        self._replica.record(entry)
