"""RoutingService: what every shim calls per request. Translation only."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import grpc
from opentelemetry.trace import Span

from baton import wire
from baton.model import Decision, FailoverOutcome, Reason, Snapshot
from baton.tracing import OFF, SpanKind, Tracing
from baton.v1 import routing_pb2, routing_pb2_grpc
from control.api import convert
from control.api.errors import Context, abort_with, within
from control.api.leader_gate import STANDALONE, Replica, trailer
from control.exceptions import FactsError, NotLeader, RegistryError
from control.metrics import ControlMetrics
from control.routing.router import Router
from control.signals.facts import ReadFacts

OK = routing_pb2.OUTCOME_OK
QUEUED = routing_pb2.ROUTE_REASON_QUEUED
# Sends a message to the shim a route came from, later (a queued request's answer).
Send = Callable[[routing_pb2.RouteStreamResponse], None]


class RoutingServicer(routing_pb2_grpc.RoutingServiceServicer):
    def __init__(
        self,
        router: Router,
        metrics: ControlMetrics,
        read_facts: ReadFacts,
        tracing: Tracing = OFF,
        replica: Replica = STANDALONE,
    ) -> None:
        """`replica`: this control's part as one of several on etcd (control/replicas/):
        streams already open end when it stops leading (new calls are refused by
        control/api/leader_gate.py), and what a shim must not lose is in etcd before the
        shim is answered. STANDALONE: a control on its own, which always leads."""
        self._leadership = replica
        self._watchers: set[asyncio.Event] = set()
        self._read_facts = read_facts
        self._router = router
        self._metrics = metrics
        self._policy = router.policy.name
        self._tracing = tracing
        self.route_port = 0  # control's route socket, told to shims with every snapshot

    def _route(
        self, r: routing_pb2.RouteRequest, later: Send | None = None
    ) -> routing_pb2.RouteResponse:
        """`later`: where the answer goes if the request must wait (the router keeps it)."""
        started = time.perf_counter()
        with self._traced("baton.control.route", r.traceparent, r.request_id) as span:
            request = convert.route_request_from_pb(r.request_id, r.shape)
            decision = self._router.route(request, reply=later)
            if span is not None:
                span.set_attribute("baton.reason", decision.reason.value)
                if r.shape.tenant:
                    span.set_attribute("baton.tenant", r.shape.tenant)
                span.set_attribute(
                    "baton.backend", decision.backends[0].id if decision.backends else ""
                )
        self._metrics.route_seconds.observe(time.perf_counter() - started)
        self._metrics.routes.labels(self._policy, decision.reason.value).inc()
        return wire.route_response(decision)

    def _traced(
        self, name: str, traceparent: str, request_id: str
    ) -> AbstractContextManager[Span | None]:
        """A SERVER span, child of the shim's span whose context rode in the message."""
        if not (self._tracing.enabled and traceparent):
            return nullcontext(None)
        return self._tracing.span(
            name, SpanKind.SERVER, Tracing.context_from(traceparent), request_id=request_id
        )

    async def Route(
        self, request: routing_pb2.RouteRequest, context: Context
    ) -> routing_pb2.RouteResponse:
        # One question, one answer: a unary caller that must wait waits here for its turn.
        turn: asyncio.Future[routing_pb2.RouteResponse] = asyncio.get_running_loop().create_future()

        def send(msg: routing_pb2.RouteStreamResponse) -> None:
            if not turn.done():
                turn.set_result(msg.results[0].response)

        answer = self._route(request, send)
        if answer.reason != QUEUED:
            return answer
        return await turn

    async def RouteStream(
        self,
        request_iterator: AsyncIterator[routing_pb2.RouteStreamRequest],
        context: Context,
    ) -> AsyncIterator[routing_pb2.RouteStreamResponse]:
        # Answers go out as they are ready: at once, or later for a request that waited in
        # its band, so the reading is a task of its own.
        out: asyncio.Queue[routing_pb2.RouteStreamResponse | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    answer = self.answer(msg, out.put_nowait)
                    if answer is not None:
                        out.put_nowait(answer)
            finally:
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await out.get()) is not None:
                yield answer
            await reader  # its error, if it ended with one
        except NotLeader as exc:
            await self._refuse(context, str(exc))
        finally:
            reader.cancel()

    async def _refuse(self, context: Context, why: str) -> None:
        leader = self._leadership.refusal()[1]
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why, trailer(leader))

    def role_changed(self) -> None:
        """A replica's role changed: snapshot watchers look (and leave, if it stopped
        leading)."""
        for changed in self._watchers:
            changed.set()

    def answer(
        self, msg: routing_pb2.RouteStreamRequest, later: Send | None = None
    ) -> routing_pb2.RouteStreamResponse | None:
        """One RouteStream message's outcomes taken in and its questions answered (None: it
        asked none), whether it came over gRPC or over the route socket. A request that must
        wait for room is answered QUEUED now, and for real through `later` when its turn
        comes. A replica that does not lead raises NotLeader, deciding nothing."""
        if not self._leadership.leading:
            raise NotLeader(self._leadership.refusal()[0])
        if msg.outcomes:
            self._finished(msg.outcomes)
        results = []
        for r in msg.routes:
            response = self._route(r, later)
            results.append(routing_pb2.RouteResult(request_id=r.request_id, response=response))
        if self._router.waiting:
            self.drain()
        results += [
            routing_pb2.RouteResult(
                request_id=f.request_id, response=wire.route_response(self._failover(f, later))
            )
            for f in msg.failovers
        ]
        return routing_pb2.RouteStreamResponse(results=results) if results else None

    def _finished(self, outcomes: Iterable[routing_pb2.RequestOutcome]) -> None:
        self._router.finished(wire.outcome_from_pb(o) for o in outcomes)

    def drain(self) -> None:
        """Queued requests whose turn came (or whose wait ended) get their answers (the
        router's, control/routing/admission.py), batched by the stream they came on."""
        batches: dict[Send, list[routing_pb2.RouteResult]] = {}
        for a in self._router.dequeue():
            self._metrics.routes.labels(self._policy, a.decision.reason.value).inc()
            if a.reply is not None:
                result = routing_pb2.RouteResult(
                    request_id=a.request_id, response=wire.route_response(a.decision)
                )
                batches.setdefault(a.reply, []).append(result)
        for send, results in batches.items():
            send(routing_pb2.RouteStreamResponse(results=results))

    async def ReportAttemptFailure(
        self, request: routing_pb2.ReportAttemptFailureRequest, context: Context
    ) -> routing_pb2.ReportAttemptFailureResponse:
        self._metrics.retries.labels(request.backend_id).inc()
        self._router.attempt_failed(
            request.request_id,
            request.backend_id,
            wire.failure_from_pb(request.failure_class, request.failure),
            request.detail,
        )
        await self._leadership.sync()
        return routing_pb2.ReportAttemptFailureResponse()

    async def ReportOutcomes(
        self, request: routing_pb2.ReportOutcomesRequest, context: Context
    ) -> routing_pb2.ReportOutcomesResponse:
        self._finished(request.outcomes)
        return routing_pb2.ReportOutcomesResponse()

    async def Failover(
        self, request: routing_pb2.FailoverRequest, context: Context
    ) -> routing_pb2.FailoverResponse:
        # A resume that must wait for its adapter's load is answered when the load ends.
        turn: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()

        def send(msg: routing_pb2.RouteStreamResponse) -> None:
            if not turn.done():
                turn.set_result(wire.decision_from_pb(msg.results[0].response))

        decision = self._failover(request, send)
        if decision.reason is Reason.QUEUED:
            decision = await turn
        return wire.failover_response(decision)

    def _failover(
        self, request: routing_pb2.FailoverRequest, later: Send | None = None
    ) -> Decision:
        """`later`: where the answer goes if the resume must wait for its adapter's load."""
        route_request = convert.route_request_from_pb(
            request.request_id, request.shape, tuple(request.exclude_backend_ids)
        )
        with self._traced("baton.control.failover", request.traceparent, request.request_id):
            return self._router.failover(
                route_request,
                request.failed_backend_id,
                wire.failure_from_pb(request.failure_class, request.failure),
                preferred=tuple(request.preferred_backend_ids),
                pair_id=request.pair_id,
                reply=later,
            )

    async def ReportFailover(
        self, request: routing_pb2.ReportFailoverRequest, context: Context
    ) -> routing_pb2.ReportFailoverResponse:
        fields = convert.failover_event(request)
        self._metrics.failovers.labels(fields.failure, fields.seam, fields.outcome).inc()
        if fields.outcome is FailoverOutcome.RESUMED:
            self._metrics.failover_gap.observe(request.gap_ms / 1000)
        self._router.registry.events.record(
            fields, request_id=request.request_id, backend_id=request.from_backend_id
        )
        await self._leadership.sync()
        return routing_pb2.ReportFailoverResponse()

    async def GatePairing(
        self, request: routing_pb2.GatePairingRequest, context: Context
    ) -> routing_pb2.GatePairingResponse:
        registry = self._router.registry
        facts = None
        target = registry.snapshot.get(request.target_backend_id)
        if target is not None:
            # The prober read them as the backend (re)joined, before it was routable again
            # (a replica restarted with another tokenizer is read anew then); read them now
            # only if it has none, within the shim's deadline or not at all (fail closed).
            facts = registry.facts.get(target.backend.id)
            if facts is None:
                with contextlib.suppress(FactsError):
                    facts = await self._read_facts(target.backend, within(context))
        with self._traced("baton.control.gate", request.traceparent, request.request_id):
            try:
                result = self._router.pairs.gate_pairing(
                    request.pair_id,
                    request.target_backend_id,
                    request.drafted,
                    request.accepted,
                    facts,
                )
            except RegistryError as exc:
                await abort_with(context, exc)
                raise
        self._metrics.pair_verdicts.labels(result.verdict.value).inc()
        return convert.gate_response(result)

    async def RecordOwnership(
        self, request: routing_pb2.RecordOwnershipRequest, context: Context
    ) -> routing_pb2.RecordOwnershipResponse:
        if request.released:
            self._router.release_owner(request.key)
        elif request.key and request.backend_id:
            self._router.record_owner(request.key, request.backend_id, request.model)
        else:
            return routing_pb2.RecordOwnershipResponse()
        await self._leadership.own(request.key, request.backend_id, request.model,
                                   request.released)  # fmt: skip
        return routing_pb2.RecordOwnershipResponse()

    async def WatchSnapshots(
        self, request: routing_pb2.WatchSnapshotsRequest, context: Context
    ) -> AsyncIterator[routing_pb2.WatchSnapshotsResponse]:
        registry = self._router.registry
        changed = asyncio.Event()
        changed.set()  # send the current snapshot at once

        # Only the newest snapshot matters to a watcher, so a flag (not a queue) is enough:
        # a slow watcher skips versions instead of buffering them.
        def on_publish(_: Snapshot) -> None:
            changed.set()

        unsubscribe = registry.subscribe(on_publish)
        registry.shims_watching(1)
        self._watchers.add(changed)
        sent = request.after_version
        try:
            while True:
                await changed.wait()
                changed.clear()
                if not self._leadership.leading:
                    await self._refuse(context, self._leadership.refusal()[0])
                snap = registry.snapshot
                if snap.version > sent:
                    sent = snap.version
                    yield routing_pb2.WatchSnapshotsResponse(
                        snapshot=wire.snapshot_to_pb(snap, registry.in_flight()),
                        route_port=self.route_port,
                    )
        finally:
            self._watchers.discard(changed)
            unsubscribe()
            registry.shims_watching(-1)
