"""The shim's link to control over gRPC: ControlLink, which serves every Protocol of
dataplane/link/needs.py.

Routes and outcome reports share one RouteStream; a finished request costs the client
nothing, and control sees load drop with the next route or within one flush interval.

When control is unreachable (docs/architecture.md#when-control-is-unreachable) the shim keeps
serving: routes and failovers are decided from the last snapshot (dataplane/link/degraded.py),
reports wait in bounded buffers (outcomes in the RouteStream, attempt failures and failover reports
in the Outbox), and a probe watches control's health service until it answers again, then everything
buffered is sent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Sequence

import grpc
from grpc_health.v1 import health_pb2

from baton import wire
from baton.ledger import Ledger
from baton.model import Decision, FailoverReport, Failure, RequestOutcome, RequestShape
from baton.v1 import routing_pb2, routing_pb2_grpc
from dataplane.exceptions import ControlRefused, ControlUnavailable, StreamBroken
from dataplane.link.calls import Calls
from dataplane.link.degraded import DegradedRouter
from dataplane.link.needs import FleetView, GateAnswer, fleet_view
from dataplane.link.outbox import Outbox, Report
from dataplane.link.route_socket import split_target
from dataplane.link.routestream import RouteStream
from dataplane.metrics import LinkStats

log = logging.getLogger("baton.shim.control")

ROUTING_SERVICE = routing_pb2.DESCRIPTOR.services_by_name["RoutingService"].full_name
# A control plane that comes back (often a new process on the same address) is found within
# about a second, not after gRPC's default backoff of up to two minutes.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


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
        """`route_timeout` bounds what a hung control costs a request (a refused connection
        costs nothing: it fails at once); after the first failure requests are routed
        locally at once until the probe, every `probe_interval`, finds control serving.
        `max_buffered` bounds each buffer (outcomes; other reports) while control is away.
        `token`: the shim token control's routing service asks for (the health probe is open).
        `tls_ca`: PEM of the CA that signed control's certificate: talk TLS."""
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(tls_ca)
            self._channel = grpc.aio.secure_channel(target, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = routing_pb2_grpc.RoutingServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        # grpc.health.v1 (served by control next to RoutingService): the probe while away.
        self._health_check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        self._timeout = route_timeout
        self._report_timeout = report_timeout
        self._flush_interval = flush_interval
        self._probe_interval = probe_interval
        self._up = asyncio.Event()  # set while control is believed reachable
        self._up.set()
        self._down_since = 0.0
        self._stream = RouteStream(
            self._stub,
            max_outcomes=max_buffered,
            timeout=route_timeout,
            on_broken=self._unreachable,
            metadata=self._metadata,
            tls_ca=tls_ca,
        )
        # Control's host, where its route socket listens (None: a target with a scheme,
        # routed over gRPC's RouteStream).
        self._control_host = (split_target(target) or (None, 0))[0]
        self._outbox = Outbox(max_buffered, up=self._up, on_unreachable=self._unreachable)
        self._calls = Calls(self._stub, self._metadata, route_timeout, self._up, self._unreachable)
        self._local = DegradedRouter()
        # While control is away: each tenant's share of its limits, counted here alone
        # (baton/ledger.py). Requests control admitted are not in it.
        self._ledger = Ledger()
        self._backends = wire.Backends()
        self._fleet = FleetView()
        self._first_snapshot = asyncio.Event()
        self._refused: str | None = None  # control refused our credential: why
        self._refusal = asyncio.Event()
        self._poke = asyncio.Event()  # a snapshot arrived: probe control now
        self._tasks: list[asyncio.Task[None]] = []
        self._prober: asyncio.Task[None] | None = None
        self._degraded_routes = 0
        self._outages = 0
        self._closing = False

    @property
    def fleet(self) -> FleetView:
        return self._fleet

    @property
    def has_snapshot(self) -> bool:
        """Whether a request could be routed now: control has sent a snapshot (routing goes
        on from it while control is unreachable)."""
        return self._first_snapshot.is_set()

    @property
    def degraded(self) -> bool:
        return not self._up.is_set()

    def link_stats(self) -> LinkStats:
        return LinkStats(
            degraded=self.degraded,
            outages=self._outages,
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
        self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._flusher())]
        either = [
            asyncio.create_task(self._first_snapshot.wait()),
            asyncio.create_task(self._refusal.wait()),
        ]
        await asyncio.wait(either, timeout=wait_for_snapshot, return_when=asyncio.FIRST_COMPLETED)
        for t in either:
            t.cancel()
        if self._refused is not None and not self._first_snapshot.is_set():
            # A shim control will not talk to can only fail every request: say so and stop.
            await self.close()
            raise ControlRefused(self._refused)
        if not self._first_snapshot.is_set():
            log.warning("no snapshot from control yet; serving /v1/models empty until it comes")

    async def close(self) -> None:
        self._closing = True  # the stream breaking now is our doing, not an outage
        # Reports still queued get a moment to reach control before the shim exits.
        await self._outbox.close(self._report_timeout)
        tasks = [*self._tasks, *([self._prober] if self._prober else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self._stream.close()
        await self._channel.close()

    # -- decisions -----------------------------------------------------------------------

    async def route(self, request_id: str, shape: RequestShape, traceparent: str = "") -> Decision:
        if self._up.is_set():
            request = routing_pb2.RouteRequest(
                request_id=request_id, shape=wire.shape_to_pb(shape), traceparent=traceparent
            )
            try:
                return await self._decision(self._stream.route(request))
            except ControlUnavailable as exc:
                self._unreachable(str(exc))
            except asyncio.CancelledError:
                # The client left before its answer (it may be waiting in its band): control
                # drops it, and counts it no longer for its tenant.
                gone = RequestOutcome(request_id=request_id, backend_id="", model=shape.model,
                                      ok=False, http_status=499)  # fmt: skip
                self.finished(gone)
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
            self._ledger.cancel(request_id)
        return decision

    def _admit_locally(self, request_id: str, shape: RequestShape) -> Decision | None:
        """The tenant's share of its limits, while control is away (None: admitted)."""
        if not shape.tenant:
            return None
        snap = self._fleet.snapshot
        admission = self._ledger.admit(
            request_id, shape.tenant, self._fleet.tenants.get(shape.tenant), shape.model,
            shape.tokens_estimate(), time.time(), share=self.tenant_share,
        )  # fmt: skip
        if admission.refused is None:
            return None
        return Decision((), admission.refused, snap.version, admission.detail,
                        quota=admission.quota)  # fmt: skip

    @property
    def tenant_share(self) -> int:
        """Of how many shims this one enforces a share of each tenant's limits: the shims
        control last counted, while it is away; 1 (control enforces them whole) otherwise."""
        return max(self._fleet.snapshot.shims, 1) if self.degraded else 1

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
        if self._up.is_set():
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
            try:
                return await self._decision(self._stream.failover(request))
            except ControlUnavailable as exc:
                self._unreachable(str(exc))
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
        if not self._first_snapshot.is_set():
            raise ControlUnavailable("control plane unreachable and no snapshot from it yet")
        self._degraded_routes += 1
        return self._local.route(self._fleet.snapshot, model, exclude=exclude, preferred=preferred)

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
            Report(
                "attempt_failure",
                lambda: self._stub.ReportAttemptFailure(
                    msg, timeout=self._report_timeout, metadata=self._metadata
                ),
            )
        )

    def report_failover(self, report: FailoverReport) -> None:
        msg = wire.failover_report_to_pb(report)
        self._outbox.put(
            Report(
                "failover",
                lambda: self._stub.ReportFailover(
                    msg, timeout=self._report_timeout, metadata=self._metadata
                ),
            )
        )

    def finished(self, outcome: RequestOutcome) -> None:
        self._ledger.finished(
            outcome.request_id, outcome.prompt_tokens, outcome.completion_tokens,
            outcome.engine_refused,
        )  # fmt: skip
        self._stream.report(wire.outcome_to_pb(outcome))

    async def _flusher(self) -> None:
        # Outcomes ride along with routes; this only matters when the shim goes idle. While
        # control is away they stay queued (bounded) instead of being retried every tick.
        while True:
            await asyncio.sleep(self._flush_interval)
            if self._up.is_set():
                self._stream.flush()

    # -- control's reachability ----------------------------------------------------------

    def _unreachable(self, reason: str) -> None:
        if not self._up.is_set() or self._closing:
            return
        self._up.clear()
        self._outages += 1
        self._down_since = time.monotonic()
        log.warning(
            "control plane unreachable (%s): routing from snapshot v%d, buffering reports",
            reason,
            self._fleet.version,
        )
        self._prober = asyncio.create_task(self._probe())

    async def _probe(self) -> None:
        """Until control's health service says SERVING; then trust control again."""
        request = health_pb2.HealthCheckRequest(service=ROUTING_SERVICE)
        while True:
            self._poke.clear()
            try:
                resp = await self._health_check(request, timeout=self._timeout)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._probe_interval)
        log.warning(
            "control plane back after %.1fs: sending %d outcomes and %d reports",
            time.monotonic() - self._down_since,
            self._stream.buffered_outcomes,
            len(self._outbox),
        )
        self._up.set()
        self._stream.flush()

    async def _watch(self) -> None:
        after = 0
        while True:
            try:
                stream = self._stub.WatchSnapshots(
                    routing_pb2.WatchSnapshotsRequest(after_version=after),
                    metadata=self._metadata,
                )
                fresh = True
                async for msg in stream:
                    if self._control_host is not None:
                        port = msg.route_port
                        self._stream.use_socket(
                            (self._control_host, port) if port else None, fresh=fresh
                        )
                        fresh = False
                    snapshot = wire.snapshot_from_pb(msg.snapshot)
                    after = snapshot.version
                    self._fleet = fleet_view(snapshot)
                    self._first_snapshot.set()
                    self._poke.set()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    if self._refused is None:
                        log.error("control refused this shim: %s", exc.details())
                    self._refused = f"control refused this shim: {exc.details()}"
                    self._refusal.set()
                else:
                    log.debug("snapshot watch: %s; reconnecting", exc.code().name)
            # Control restarts start versions again from 1: accept whatever it sends next.
            after = 0
            await asyncio.sleep(0.5)
