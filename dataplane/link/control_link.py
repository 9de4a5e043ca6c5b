"""The shim's link to control over gRPC: ControlLink, the facade that serves every Protocol of
dataplane/link/needs.py, made of parts that each do one job.

Routes and outcome reports share one RouteStream (dataplane/link/routestream.py); a finished
request costs the client nothing, and control sees load drop with the next route or within one
flush interval. Reports that must arrive go through the Outbox (dataplane/link/outbox.py); the
calls a request waits for through Calls (dataplane/link/calls.py). Control's snapshots come
from the SnapshotWatch (dataplane/link/snapshots.py).

When control is unreachable (docs/architecture.md#when-control-is-unreachable) the shim keeps
serving: routes and failovers are decided here from the last snapshot (dataplane/link/degraded.py),
each tenant's share of its limits and budgets counted here (dataplane/link/local_admission.py),
reports wait in bounded buffers (outcomes in the RouteStream, attempt failures and failover
reports in the Outbox), and the Leader (dataplane/link/leader.py) probes control's health
service until it answers again, then everything buffered is sent.

Given several addresses (`--control A,B,C`: control replicas, of which one leads) the link talks to
one at a time, the leader, as the Leader knows it: every call reads its stub when it goes, and a
move restarts the watch and the RouteStream there; what was buffered goes there, once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc

from baton import wire
from baton.model import Decision, FailoverReport, Failure, RequestOutcome, RequestShape
from baton.v1 import routing_pb2, routing_pb2_grpc
from dataplane.exceptions import ControlRefused, ControlUnavailable, StreamBroken
from dataplane.link.calls import Calls
from dataplane.link.degraded import DegradedRouter
from dataplane.link.leader import Leader, Target
from dataplane.link.local_admission import LocalAdmission
from dataplane.link.needs import FleetView, GateAnswer
from dataplane.link.outbox import TRANSIENT, Outbox, Report, not_leader
from dataplane.link.routestream import RouteStream
from dataplane.link.snapshots import SnapshotWatch
from dataplane.metrics import LinkStats
from dataplane.outcomes import outcome

log = logging.getLogger("baton.shim.control")


class ControlLink:
    def __init__(
        self,
        target: str,
        *,
        route_timeout: float = 0.5,
        report_timeout: float = 2.0,
        flush_interval: float = 0.05,
        probe_interval: float = 0.5,
        max_buffered: int = 10_000,
        token: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        """`target`: control's HOST:PORT, or its replicas' as A,B,C (the link finds the
        leader). `route_timeout` bounds what a hung control costs a request (a refused
        connection costs nothing: it fails at once); after the first failure requests are
        routed locally at once until the probe, every `probe_interval`, finds control serving.
        `max_buffered` bounds each buffer (outcomes; other reports) while control is away.
        `token`: the shim token control's routing service asks for (the health probe is open).
        `tls_ca`: PEM of the CA that signed control's certificate: talk TLS."""
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = route_timeout
        self._report_timeout = report_timeout
        self._flush_interval = flush_interval
        self._leader = Leader(
            target,
            tls_ca=tls_ca,
            timeout=route_timeout,
            probe_interval=probe_interval,
            on_down=self._down,
            on_move=self._moved,
            on_back=self._back,
        )
        self._stream = RouteStream(
            self._leader.stub,
            max_outcomes=max_buffered,
            timeout=route_timeout,
            on_broken=self._leader.unreachable,
            metadata=self._metadata,
            tls_ca=tls_ca,
        )
        self._watch = SnapshotWatch(
            self._leader, self._metadata, self._stream.use_socket, several=self._leader.several
        )
        # A report's failure marks control away in _report (which knows where it went).
        self._outbox = Outbox(max_buffered, up=self._leader.up, on_unreachable=lambda reason: None)
        self._calls = Calls(self._leader, self._metadata, route_timeout)
        self._local = DegradedRouter()
        # While control is away: each tenant's share of its limits and budgets, counted here
        # alone (dataplane/link/local_admission.py). Requests control admitted are not in it.
        self._admission = LocalAdmission()
        self._backends = wire.Backends()
        self._tasks: list[asyncio.Task[None]] = []
        self._degraded_routes = 0

    @property
    def fleet(self) -> FleetView:
        return self._watch.fleet

    @property
    def has_snapshot(self) -> bool:
        """Whether a request could be routed now: control has sent a snapshot (routing goes
        on from it while control is unreachable)."""
        return self._watch.has_snapshot

    @property
    def degraded(self) -> bool:
        return not self._leader.up.is_set()

    def link_stats(self) -> LinkStats:
        return LinkStats(
            degraded=self.degraded,
            outages=self._leader.outages,
            degraded_routes=self._degraded_routes,
            buffered_outcomes=self._stream.buffered_outcomes,
            dropped_outcomes=self._stream.dropped_outcomes,
            buffered_reports=len(self._outbox),
            dropped_reports=dict(self._outbox.dropped),
            rejected_reports=self._outbox.rejected,
            tenant_share=self.tenant_share,
            route_socket=self._stream.over_socket,
        )

    async def start(self, wait_for_snapshot: float = 10.0) -> None:
        self._watch.start(self._leader.at)
        self._tasks = [asyncio.create_task(self._flusher())]
        await self._watch.first(wait_for_snapshot)
        refused = self._watch.refused
        if refused is not None and not self._watch.has_snapshot:
            # A shim control will not talk to can only fail every request: say so and stop.
            await self.close()
            raise ControlRefused(refused)
        if not self._watch.has_snapshot:
            log.warning("no snapshot from control yet; serving /v1/models empty until it comes")

    async def close(self) -> None:
        self._leader.closing()  # the stream breaking now is our doing, not an outage
        # Reports still queued get a moment to reach control before the shim exits.
        await self._outbox.close(self._report_timeout)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self._watch.stop()
        await self._leader.stop()
        await self._stream.close()
        await self._leader.close()

    # -- decisions -----------------------------------------------------------------------

    async def route(self, request_id: str, shape: RequestShape, traceparent: str = "") -> Decision:
        if self._leader.up.is_set():
            request = routing_pb2.RouteRequest(
                request_id=request_id, shape=wire.shape_to_pb(shape), traceparent=traceparent
            )
            stub = self._leader.stub
            try:
                return await self._decision(self._stream.route(request))
            except ControlUnavailable as exc:
                self._leader.unreachable(str(exc), via=stub)
            except asyncio.CancelledError:
                # The client left before its answer (it may be waiting in its band): control
                # drops it, and counts it no longer for its tenant.
                self.finished(outcome(request_id, "", shape.model, 499, ok=False))
                raise
        if shape.owner_key:
            # Only control knows which backend holds it; any other would answer a misleading
            # 404 (or, worse, hold another response of that id).
            raise ControlUnavailable(
                f"control plane unreachable: the backend holding {shape.owner_key} is unknown"
            )
        refusal = self._admit_locally(request_id, shape)
        if refusal is not None:
            return refusal
        decision = self._decide_locally(shape.model)
        if not decision.backends:
            self._admission.cancel(request_id)
        return decision

    def _admit_locally(self, request_id: str, shape: RequestShape) -> Decision | None:
        """The tenant's share of its limits and budgets, while control is away (None:
        admitted)."""
        if not shape.tenant:
            return None
        return self._admission.admit(request_id, shape, self.fleet.snapshot,
                                     self.fleet.tenants.get(shape.tenant), time.time(),
                                     self.tenant_share)  # fmt: skip

    @property
    def tenant_share(self) -> int:
        """Of how many shims this one enforces a share of each tenant's limits: the shims
        control last counted, while it is away; 1 (control enforces them whole) otherwise."""
        return max(self.fleet.snapshot.shims, 1) if self.degraded else 1

    async def failover(
        self,
        request_id: str,
        shape: RequestShape,
        failed_backend_id: str,
        failure: Failure,
        exclude: Sequence[str],
        preferred: Sequence[str] = (),
        traceparent: str = "",
        pair_id: str = "",
    ) -> Decision:
        if self._leader.up.is_set():
            request = routing_pb2.FailoverRequest(
                pair_id=pair_id,
                traceparent=traceparent,
                request_id=request_id,
                shape=wire.shape_to_pb(shape),
                failed_backend_id=failed_backend_id,
                **wire.failure_fields(failure),
                exclude_backend_ids=list(exclude),
                preferred_backend_ids=list(preferred),
            )
            stub = self._leader.stub
            try:
                return await self._decision(self._stream.failover(request))
            except ControlUnavailable as exc:
                self._leader.unreachable(str(exc), via=stub)
        return self._decide_locally(
            shape.model, exclude=(failed_backend_id, *exclude), preferred=preferred
        )

    async def _decision(self, answer: Awaitable[routing_pb2.RouteResponse]) -> Decision:
        """One answer from the RouteStream, with its failures in the link's terms."""
        try:
            resp = await answer
        except TimeoutError:
            raise ControlUnavailable(
                f"control plane did not answer within {self._timeout:g}s"
            ) from None
        except StreamBroken as exc:
            raise ControlUnavailable(f"control plane: {exc}") from None
        return wire.decision_from_pb(resp, self._backends)

    def _decide_locally(
        self, model: str, exclude: Sequence[str] = (), preferred: Sequence[str] = ()
    ) -> Decision:
        if not self._watch.has_snapshot:
            raise ControlUnavailable("control plane unreachable and no snapshot from it yet")
        self._degraded_routes += 1
        return self._local.route(self.fleet.snapshot, model, exclude=exclude, preferred=preferred)

    async def gate_pairing(
        self, request_id: str, pair_id: str, target_id: str, drafted: int, accepted: int
    ) -> GateAnswer:
        return await self._calls.gate_pairing(request_id, pair_id, target_id, drafted, accepted)

    async def record_owner(
        self, request_id: str, key: str, backend_id: str, model: str, *, released: bool = False
    ) -> None:
        await self._calls.record_owner(request_id, key, backend_id, model, released=released)

    # -- reports: buffered while control is away -----------------------------------------

    async def attempt_failed(
        self, request_id: str, backend_id: str, failure: Failure, detail: str
    ) -> None:
        msg = routing_pb2.ReportAttemptFailureRequest(
            request_id=request_id, backend_id=backend_id, detail=detail,
            **wire.failure_fields(failure),
        )  # fmt: skip
        # The retry proceeds regardless; the prober will demote the backend too.
        self._outbox.put(
            self._report(
                "attempt_failure",
                lambda stub: stub.ReportAttemptFailure(
                    msg, timeout=self._report_timeout, metadata=self._metadata
                ),
            )
        )

    def report_failover(self, report: FailoverReport) -> None:
        msg = wire.failover_report_to_pb(report)
        self._outbox.put(
            self._report(
                "failover",
                lambda stub: stub.ReportFailover(
                    msg, timeout=self._report_timeout, metadata=self._metadata
                ),
            )
        )

    def _report(
        self,
        kind: str,
        call: Callable[[routing_pb2_grpc.RoutingServiceAsyncStub], Awaitable[object]],
    ) -> Report:
        """A report for the Outbox, sent to whichever replica leads when it goes. A failure
        that says control is away marks it so here, where the replica it went to is known:
        the Outbox keeps the report and sends it again once `up`."""

        async def send() -> object:
            stub = self._leader.stub
            try:
                return await call(stub)
            except grpc.aio.AioRpcError as exc:
                leader = not_leader(exc)
                if exc.code() in TRANSIENT or leader is not None:
                    self._leader.unreachable(
                        f"{kind} report: {exc.code().name}", leader or "", stub
                    )
                raise

        return Report(kind, send)

    def finished(self, outcome: RequestOutcome) -> None:
        self._admission.finished(outcome, self.fleet.snapshot, time.time())
        self._stream.report(wire.outcome_to_pb(outcome))

    async def _flusher(self) -> None:
        # Outcomes ride along with routes; this only matters when the shim goes idle. While
        # control is away they stay queued (bounded) instead of being retried every tick.
        while True:
            await asyncio.sleep(self._flush_interval)
            if self._leader.up.is_set():
                self._stream.flush()

    # -- told by the Leader ----------------------------------------------------------------

    def _down(self, reason: str) -> None:
        log.warning(
            "control plane unreachable (%s): routing from snapshot v%d, buffering reports",
            reason,
            self.fleet.version,
        )

    def _moved(self, to: Target) -> None:
        """The RouteStream and the snapshot watch, restarted at the new leader (versions start
        again per replica: the watch takes whatever it sends). Calls and reports read the
        Leader's stub when they go."""
        self._stream.retarget(to.stub)
        self._watch.start(to)

    def _back(self, was: Target, now: Target, away: float) -> None:
        log.warning(
            "%s after %.1fs: sending %d outcomes and %d reports",
            f"control leader is now {now.address} (was {was.address})"
            if now is not was
            else "control plane back",
            away,
            self._stream.buffered_outcomes,
            len(self._outbox),
        )
        self._stream.flush()
