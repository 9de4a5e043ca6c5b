"""Reports to control that must arrive: attempt failures and failover reports (each becomes an
audit event in control).

While control is reachable they go at once, in order, sent by one task. While it is not they
wait here, bounded (when full the newest report is dropped and counted), and go when control
is back, which may be a new control process on the same address, or another replica that leads
now (a replica that does not lead refuses a report unapplied: it is kept for the leader).
Delivery is at least once: a report whose answer was lost (control died after taking it) is sent
again and may show up twice in the audit log; a report lost without a trace would be worse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from baton.replicas import leader_in, says_not_leader

log = logging.getLogger("baton.shim.outbox")

# Codes that say "control is not there (yet)", not "control refused this report": the report
# is kept and sent again when control is back. Anything else is dropped and counted.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)


def not_leader(exc: grpc.aio.AioRpcError) -> str | None:
    """None unless `exc` is a control replica's "not the leader" refusal; then the leader's
    address it names ("" when it knows none)."""
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    leader = leader_in(exc.trailing_metadata())
    return leader if says_not_leader(exc.details(), leader) else None


@dataclass(frozen=True, slots=True)
class Report:
    kind: str  # attempt_failure | failover: the metric label
    send: Callable[[], Awaitable[object]]  # one RPC, with its own timeout


class Outbox:
    def __init__(
        self,
        capacity: int,
        *,
        up: asyncio.Event,
        on_unreachable: Callable[[str], None],
    ) -> None:
        """`up`: set while control is believed reachable (the link's Leader owns it);
        `on_unreachable`: told when a send fails for a transient reason (ControlLink's
        reports tell the Leader themselves, which then probes control until it answers)."""
        self._queue: deque[Report] = deque()
        self._capacity = capacity
        self._up = up
        self._on_unreachable = on_unreachable
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()  # set whenever the queue has just been emptied
        self._task: asyncio.Task[None] | None = None
        self.dropped: dict[str, int] = {}
        self.rejected = 0
        self.delivered = 0

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, report: Report) -> None:
        if len(self._queue) >= self._capacity:
            self.dropped[report.kind] = self.dropped.get(report.kind, 0) + 1
            return
        self._queue.append(report)
        self._empty.clear()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._up.wait()
            report = self._queue[0]
            try:
                await report.send()
            except grpc.aio.AioRpcError as exc:
                if exc.code() in TRANSIENT or not_leader(exc) is not None:
                    # Kept at the head: order is preserved and it goes first when control
                    # is back. The Leader clears `up`, so this does not spin.
                    self._on_unreachable(f"{report.kind} report: {exc.code().name}")
                    if self._up.is_set():
                        await asyncio.sleep(0.1)  # `up` left set (shutting down): pace
                    continue
                log.warning("control refused a %s report: %s", report.kind, exc.code().name)
                self.rejected += 1
            else:
                self.delivered += 1
            self._queue.popleft()
            if not self._queue:
                self._empty.set()

    async def close(self, grace: float) -> None:
        """Give queued reports up to `grace` seconds to go (a shim stopping while control is
        up should not lose them), then stop."""
        if self._task is None:
            return
        if self._queue and self._up.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._empty.wait(), grace)
        if self._queue:
            log.warning("%d reports to control not delivered at shutdown", len(self._queue))
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
