"""The shim's end of RouteStream: one long-lived bidirectional stream to control that
carries every Route request and outcome report, batched.

Why: a unary gRPC call from Python costs ~0.5 ms of round trip and ~0.3 ms of CPU across
both ends; a message on an open stream costs well under half, and under load many requests
share one message. One writer task sends whatever has queued since its last write.

The messages ride control's route socket (dataplane/link/route_socket.py) once control has
told its port, which costs each end a fraction of a gRPC message; gRPC's RouteStream call
(`_GrpcCall`) where it has none, or it can't be reached: the same messages either way.

When control's leader moves to another replica, retarget() points the stream at it: what is
buffered (outcomes) goes there, questions in flight are failed at once (their requests are
routed from the snapshot) and the old replica's socket is forgotten until the new one tells
its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from baton.v1 import routing_pb2, routing_pb2_grpc
from dataplane.exceptions import ControlRefused, StreamBroken
from dataplane.link.outbox import not_leader
from dataplane.link.route_socket import SocketCall

log = logging.getLogger("baton.shim.control")

SOCKET_RETRY_S = 5.0  # a route socket that failed is tried again this long after
QUEUED = routing_pb2.ROUTE_REASON_QUEUED


@dataclass(slots=True)
class _Waiter:
    """A question in flight: its answer, and when to stop waiting (on the loop's clock)."""

    fut: asyncio.Future[routing_pb2.RouteResponse]
    deadline: float


class _Call(Protocol):
    """One open stream to control, whichever way it goes."""

    async def send(self, msg: routing_pb2.RouteStreamRequest) -> None: ...

    async def finish(self, timeout: float) -> None: ...

    def cancel(self) -> None: ...


class _GrpcCall:
    """RouteStream over gRPC; its answers go to `deliver` from a reader task."""

    def __init__(
        self,
        stub: routing_pb2_grpc.RoutingServiceStub,
        metadata: tuple[tuple[str, str], ...],
        deliver: Callable[[Sequence[routing_pb2.RouteResult]], None],
        closed: Callable[[Any, str, str], None],
    ) -> None:
        """`closed(call, reason, leader)`: the leader's address when a replica that does not
        lead refused the stream and named it ("" otherwise)."""
        self._call: Any = stub.RouteStream(metadata=metadata)  # type: ignore[call-arg]
        self._deliver = deliver
        self._closed = closed
        self._reader = asyncio.create_task(self._read())

    async def send(self, msg: routing_pb2.RouteStreamRequest) -> None:
        try:
            await self._call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise StreamBroken(type(exc).__name__) from None

    async def _read(self) -> None:
        reason, leader = "stream closed by control", ""
        try:
            async for msg in self._call:
                self._deliver(msg.results)
        except grpc.aio.AioRpcError as exc:
            reason, leader = f"{exc.code().name}: {exc.details()}", not_leader(exc) or ""
        self._closed(self, reason, leader)

    async def finish(self, timeout: float) -> None:
        """Closed for writing; control answers what it was asked and ends the call (within
        `timeout`), and those answers still reach their requests."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout):
                await self._call.done_writing()
                await asyncio.wait({self._reader})
        self.cancel()

    def cancel(self) -> None:
        self._call.cancel()
        self._reader.cancel()


class RouteStream:
    def __init__(
        self,
        stub: routing_pb2_grpc.RoutingServiceStub,
        *,
        max_outcomes: int,
        timeout: float,
        on_broken: Callable[[str, str], None] = lambda reason, leader: None,
        metadata: tuple[tuple[str, str], ...] = (),
        tls_ca: bytes | None = None,
    ) -> None:
        """`on_broken`: told why whenever the stream breaks (control gone, hung on a write, or
        a replica that does not lead refused it; then the leader's address when it named one,
        else ""), so the link's Leader can stop asking control until it answers again. `metadata`:
        sent when each stream opens (the shim token). `tls_ca`: control's CA, for its route
        socket as for its gRPC."""
        self._stub = stub
        self._metadata = metadata
        self._tls_ca = tls_ca
        self._on_broken = on_broken
        self._timeout = timeout
        self._call: _Call | None = None  # while open
        # Control's route socket (host, port), once told; and the one that could not be
        # reached or refused us, left to gRPC until control tells a port again.
        self._socket: tuple[str, int] | None = None
        self._socket_failed: tuple[str, int] | None = None
        self._failed_at = 0.0  # loop time of that failure: tried again SOCKET_RETRY_S later
        self._retiring: set[asyncio.Task[None]] = set()  # gRPC calls closing after a switch
        self._moves = 0  # retarget()s so far: a socket opened across one is not kept
        # request id -> (answer, deadline on the loop clock) of each question in flight, oldest
        # first: one request can have two (a failover's call made late, then its next failover).
        # An answer goes to the oldest waiter; control answers in the order it was asked.
        # A QUEUED answer is not an answer: it moves its waiter's deadline to control's bound.
        self._pending: dict[str, list[_Waiter]] = {}
        self._routes: list[routing_pb2.RouteRequest] = []
        self._failovers: list[routing_pb2.FailoverRequest] = []
        self._outcomes: list[routing_pb2.RequestOutcome] = []
        self._max_outcomes = max_outcomes
        self._wake = asyncio.Event()
        self._write_started: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.dropped_outcomes = 0

    async def route(self, request: routing_pb2.RouteRequest) -> routing_pb2.RouteResponse:
        return await self._ask(request.request_id, request, self._routes)

    async def failover(self, request: routing_pb2.FailoverRequest) -> routing_pb2.RouteResponse:
        return await self._ask(request.request_id, request, self._failovers)

    @property
    def buffered_outcomes(self) -> int:
        return len(self._outcomes)

    @property
    def over_socket(self) -> bool:
        """Whether the open stream rides control's route socket (False: gRPC, or none open)."""
        return isinstance(self._call, SocketCall)

    def use_socket(self, address: tuple[str, int] | None, *, fresh: bool = False) -> None:
        """Control's route socket, as its latest snapshot tells (None: it has none). `fresh`:
        from a newly opened watch (control may be a new process): try a socket that failed
        before again. An open socket is kept until it breaks; the writer moves an open gRPC
        stream to a usable socket at its next batch."""
        if fresh or address != self._socket:
            self._socket_failed = None
        self._socket = address

    def retarget(self, stub: routing_pb2_grpc.RoutingServiceStub) -> None:
        """Control's leader moved: later streams go to `stub`. The open one is dropped, and
        each question asked on it fails now (StreamBroken): an answer from a replica that
        no longer leads is not wanted, and its request is routed from the snapshot at once
        rather than after the route timeout. Outcomes not yet sent stay queued for the new
        leader; the old leader's route socket is forgotten until the new one tells its own."""
        self._stub = stub
        self._moves += 1
        self._socket = self._socket_failed = None
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        # Nobody waits for these any more (their waiters fail below): not asked again.
        self._routes.clear()
        self._failovers.clear()
        for w in [e for waiting in self._pending.values() for e in waiting]:
            if not w.fut.done():
                w.fut.set_exception(StreamBroken("control's leader moved"))

    def _socket_usable(self, now: float) -> bool:
        """Control has told a socket, and it has not failed, or failed long enough ago (a
        welcome late on a loaded machine must not leave a shim on gRPC for good)."""
        if self._socket is None:
            return False
        return self._socket != self._socket_failed or now - self._failed_at >= SOCKET_RETRY_S

    def _retire(self) -> None:
        """The open gRPC call gives way: closed for writing, control answers what it has
        and ends it, and those answers still reach their requests."""
        old, self._call = self._call, None
        if old is not None:
            task = asyncio.create_task(old.finish(self._timeout))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def _start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._writer()), asyncio.create_task(self._sweep())]

    async def _ask(
        self, request_id: str, request: Any, queue: list[Any]
    ) -> routing_pb2.RouteResponse:
        loop = asyncio.get_running_loop()
        self._start()
        fut: asyncio.Future[routing_pb2.RouteResponse] = loop.create_future()
        entry = _Waiter(fut, loop.time() + self._timeout)
        waiting = self._pending.setdefault(request_id, [])
        waiting.append(entry)
        queue.append(request)
        self._wake.set()
        try:
            return await fut
        finally:
            waiting.remove(entry)
            if not waiting and self._pending.get(request_id) is waiting:
                del self._pending[request_id]

    def report(self, outcome: routing_pb2.RequestOutcome) -> None:
        """Queued; sent with the next routes, or by flush() when the shim is idle. Bounded:
        while control is unreachable they wait here, and past the bound the newest are
        dropped (and counted) rather than the shim's memory growing without limit."""
        if len(self._outcomes) >= self._max_outcomes:
            self.dropped_outcomes += 1
            return
        self._outcomes.append(outcome)

    def flush(self) -> None:
        if self._outcomes:
            self._start()  # a shim whose every route so far was decided locally
            self._wake.set()

    async def _writer(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            # One more turn of the loop before the batch is taken: the requests whose bytes
            # arrived with this turn's events join it. A message costs both ends far more
            # than a route in it, and idle, the turn costs microseconds.
            await asyncio.sleep(0)
            self._wake.clear()
            if not (self._routes or self._outcomes or self._failovers):
                continue
            self._write_started = loop.time()  # an open that hangs is a write that hangs
            if isinstance(self._call, _GrpcCall) and self._socket_usable(loop.time()):
                self._retire()
            call = self._call or await self._open()
            routes, self._routes = self._routes, []
            outcomes, self._outcomes = self._outcomes, []
            failovers, self._failovers = self._failovers, []
            try:
                await call.send(
                    routing_pb2.RouteStreamRequest(
                        routes=routes, outcomes=outcomes, failovers=failovers
                    )
                )
            except StreamBroken as exc:
                self._outcomes = outcomes + self._outcomes  # resent on the next stream
                if self._call is call:  # not a call dropped meanwhile (retarget, sweep)
                    self._broken(str(exc))
            finally:
                self._write_started = None

    async def _open(self) -> _Call:
        """The route socket when control has told one that has not failed; else gRPC."""
        address, moves = self._socket, self._moves
        if address is not None and self._socket_usable(asyncio.get_running_loop().time()):
            try:
                call = await SocketCall.open(
                    *address,
                    authorization=dict(self._metadata).get("authorization", ""),
                    tls_ca=self._tls_ca,
                    # Within the sweep's write deadline: a port that drops what is sent to it
                    # is marked failed here, not taken for a hung control again and again.
                    timeout=self._timeout / 2,
                    deliver=self._deliver,
                    closed=self._closed,
                )
                if moves == self._moves:
                    self._call = call
                    return call
                call.cancel()  # the old leader's, opened while the leader moved
            except (OSError, TimeoutError, ControlRefused, StreamBroken) as exc:
                # Unreachable from here (a port not exposed) or refused: gRPC still may be.
                self._socket_failed = address
                self._failed_at = asyncio.get_running_loop().time()
                log.warning(
                    "control's route socket %s:%d: %s; routing over gRPC instead",
                    *address, exc or type(exc).__name__,
                )  # fmt: skip
        self._call = _GrpcCall(self._stub, self._metadata, self._deliver, self._closed)
        return self._call

    def _deliver(self, results: Sequence[routing_pb2.RouteResult]) -> None:
        for result in results:
            for waiter in self._pending.get(result.request_id, ()):
                if not waiter.fut.done():
                    if result.response.reason == QUEUED:
                        # The fleet is saturated and the request waits in its band: control
                        # answers again within its bound (a wait is not a hung control).
                        now = asyncio.get_running_loop().time()
                        waiter.deadline = now + result.response.wait_ms / 1000 + self._timeout
                    else:
                        waiter.fut.set_result(result.response)
                    break

    def _closed(self, call: Any, reason: str, leader: str = "") -> None:
        if self._call is call:
            self._broken(reason, leader)

    def _broken(self, reason: str, leader: str = "") -> None:
        """Fail every waiting request now; the next route() opens a fresh stream."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        for w in [e for waiting in self._pending.values() for e in waiting]:
            if not w.fut.done():
                w.fut.set_exception(StreamBroken(reason))
        self._on_broken(reason, leader)

    async def _sweep(self) -> None:
        """Deadlines are enforced here, ten times a second, not by a timer per request: at
        one request in flight a per-call timer is a measurable share of the added latency."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(0.1, self._timeout / 4))
            now = loop.time()
            started = self._write_started
            if started is not None and now - started > self._timeout:
                # A write that never completes (control hung): restart the writer.
                self._tasks[0].cancel()
                self._tasks[0] = asyncio.create_task(self._writer())
                self._write_started = None
                self._broken("write timed out")
            for w in [e for waiting in self._pending.values() for e in waiting]:
                if w.deadline <= now and not w.fut.done():
                    w.fut.set_exception(TimeoutError())

    async def close(self) -> None:
        if self._outcomes and self._tasks:
            self._wake.set()
            await asyncio.sleep(0)  # let the writer take the last outcomes
        call, self._call = self._call, None
        if call is not None:
            await call.finish(self._timeout)
        await asyncio.gather(*self._retiring, return_exceptions=True)  # each bounded
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
