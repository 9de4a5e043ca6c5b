"""The shim's link to control over gRPC: ControlLink, which serves every Protocol of
dataplane/link/needs.py.

Routes and outcome reports share one RouteStream; a finished request costs the client
nothing, and control sees load drop with the next route or within one flush interval.

When control is unreachable (docs/architecture.md#when-control-is-unreachable) the shim keeps
serving: routes and failovers are decided from the last snapshot (dataplane/link/degraded.py),
reports wait in bounded buffers (outcomes in the RouteStream, attempt failures and failover reports
in the Outbox), and a probe watches control's health service until it answers again, then everything
buffered is sent.

Given several addresses (`--control A,B,C`: control replicas, of which one leads) the link talks to
one at a time, the leader. A replica that refuses as "not the leader" (dataplane/link/targets.py),
or one that cannot be reached, is an outage like any other, but the probe then asks every address
(the leader the refusal named first) and moves the link, watch, RouteStream and calls alike, to the
first whose health service says RoutingService is SERVING; what was buffered goes there, once.
One address is today's single control: nothing else is asked, nothing costs more."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from baton import wire
from baton.ledger import Ledger
from baton.model import Decision, FailoverReport, Failure, RequestOutcome, RequestShape
from baton.replicas import split_targets
from baton.v1 import routing_pb2, routing_pb2_grpc
from dataplane.exceptions import ControlRefused, ControlUnavailable, StreamBroken
from dataplane.link.calls import Calls
from dataplane.link.degraded import DegradedRouter
from dataplane.link.needs import FleetView, GateAnswer, fleet_view
from dataplane.link.outbox import TRANSIENT, Outbox, Report, not_leader
from dataplane.link.route_socket import split_target
from dataplane.link.routestream import RouteStream
from dataplane.link.targets import probe_order
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
HealthCheck = Callable[..., Awaitable[health_pb2.HealthCheckResponse]]
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True, slots=True)
class _Target:
    """One control address, its channel and what the link calls there; made when first
    needed and kept (a replica the link leaves may lead again)."""

    address: str
    channel: grpc.aio.Channel
    stub: routing_pb2_grpc.RoutingServiceAsyncStub
    health: HealthCheck  # grpc.health.v1 Check, served next to RoutingService (no token)
    # Where its route socket listens (None: an address with a scheme, routed over gRPC).
    host: str | None

    @classmethod
    def open(cls, address: str, tls_ca: bytes | None) -> _Target:
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(tls_ca)
            channel = grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        health = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        host = (split_target(address) or (None, 0))[0]
        return cls(address, channel, routing_pb2_grpc.RoutingServiceStub(channel), health, host)


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
        self._addresses = split_targets(target)
        self._tls_ca = tls_ca
        first = _Target.open(self._addresses[0], tls_ca)
        self._targets = {first.address: first}  # each opened when first asked, then kept
        self._at = first  # the one talked to: the leader, as far as the link knows
        self._stub = first.stub  # self._at's, read by every call when it is made
        self._leader_hint = ""  # the leader a refusal named: the probe asks it first
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
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
        # A report's failure marks control away in _report (which knows where it went).
        self._outbox = Outbox(max_buffered, up=self._up, on_unreachable=lambda reason: None)
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
        self._watcher: asyncio.Task[None] | None = None  # _watch, restarted when the leader moves
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
        self._watcher = asyncio.create_task(self._watch())
        self._tasks = [asyncio.create_task(self._flusher())]
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
        tasks = [*self._tasks, *(t for t in (self._watcher, self._prober) if t is not None)]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self._stream.close()
        for target in self._targets.values():
            await target.channel.close()

    # -- decisions -----------------------------------------------------------------------

    async def route(self, request_id: str, shape: RequestShape, traceparent: str = "") -> Decision:
        if self._up.is_set():
            request = routing_pb2.RouteRequest(
                request_id=request_id, shape=wire.shape_to_pb(shape), traceparent=traceparent
            )
            stub = self._stub
            try:
                return await self._decision(self._stream.route(request))
            except ControlUnavailable as exc:
                self._unreachable(str(exc), via=stub)
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
            stub = self._stub
            try:
                return await self._decision(self._stream.failover(request))
            except ControlUnavailable as exc:
                self._unreachable(str(exc), via=stub)
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
            stub = self._stub
            try:
                return await call(stub)
            except grpc.aio.AioRpcError as exc:
                leader = not_leader(exc)
                if exc.code() in TRANSIENT or leader is not None:
                    self._unreachable(f"{kind} report: {exc.code().name}", leader or "", stub)
                raise

        return Report(kind, send)

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

    def _unreachable(self, reason: str, leader: str = "", via: object = None) -> None:
        """Control is away: route from the snapshot, buffer reports, probe. `leader`: the
        leader a "not the leader" refusal named. `via`: the stub the failed call used; a
        failure of a replica the link has left since says nothing of the one it talks to."""
        if via is not None and via is not self._stub:
            return
        if leader:
            self._leader_hint = leader
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
        """Until an address's health service says SERVING (with several, the leader's); then
        trust it, moving there first when it is not the one the link talked to."""
        while True:
            self._poke.clear()
            found = await self._find_serving()
            if found is not None:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._probe_interval)
        was = self._at
        if found is not was:
            self._move(found)
        self._leader_hint = ""
        log.warning(
            "%s after %.1fs: sending %d outcomes and %d reports",
            f"control leader is now {found.address} (was {was.address})"
            if found is not was
            else "control plane back",
            time.monotonic() - self._down_since,
            self._stream.buffered_outcomes,
            len(self._outbox),
        )
        self._up.set()
        self._stream.flush()

    async def _find_serving(self) -> _Target | None:
        """The first address, in probe order, whose health says RoutingService is SERVING
        (a replica that does not lead says NOT_SERVING). All are asked at once: a hung one
        costs one route timeout, not one each."""
        addresses = probe_order(self._addresses, self._at.address, self._leader_hint)
        order = [self._target(a) for a in addresses]
        checks = [asyncio.create_task(self._serving(t)) for t in order]
        try:
            for target, check in zip(order, checks, strict=True):
                if await check:
                    return target
            return None
        finally:
            for check in checks:
                check.cancel()

    async def _serving(self, target: _Target) -> bool:
        request = health_pb2.HealthCheckRequest(service=ROUTING_SERVICE)
        try:
            resp = await target.health(request, timeout=self._timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == SERVING)

    def _target(self, address: str) -> _Target:
        if (target := self._targets.get(address)) is None:
            target = self._targets[address] = _Target.open(address, self._tls_ca)
        return target

    def _move(self, to: _Target) -> None:
        """Talk to `to` from now on: RouteStream, calls and reports (which read self._stub
        when they go), and the snapshot watch, restarted there (versions start again per
        replica: it takes whatever the new leader sends)."""
        self._at, self._stub = to, to.stub
        self._stream.retarget(to.stub)
        self._calls.retarget(to.stub)
        if self._watcher is not None:
            self._watcher.cancel()
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        at = self._at  # this watch's address: a move starts another watch
        several = len(self._addresses) > 1
        after = 0
        while True:
            why, leader, probe = "snapshot watch ended", "", several
            try:
                stream = at.stub.WatchSnapshots(
                    routing_pb2.WatchSnapshotsRequest(after_version=after),
                    metadata=self._metadata,
                )
                fresh = True
                async for msg in stream:
                    if at.host is not None:
                        port = msg.route_port
                        self._stream.use_socket((at.host, port) if port else None, fresh=fresh)
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
                    probe = False  # one token for every replica: none would take it
                else:
                    log.debug("snapshot watch: %s; reconnecting", exc.code().name)
                why = f"snapshot watch: {exc.code().name}: {exc.details()}"
                leader = not_leader(exc) or ""
            if probe:
                # Lost the leader, or it lost its lease: find it. This watch goes on once
                # the probe finds this address serving again (a move starts another).
                self._unreachable(why, leader, at.stub)
            # Control restarts start versions again from 1: accept whatever it sends next.
            after = 0
            await asyncio.sleep(0.5)
            if probe:
                await self._up.wait()
