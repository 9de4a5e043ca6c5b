"""What the shim needs from control, as a narrow Protocol, and its gRPC implementation.

Routes and outcome reports share one RouteStream; a finished request costs the client
nothing, and control sees load drop with the next route or within one flush interval."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from baton.v1 import routing_pb2, routing_pb2_grpc
from control.model import Backend, Decision, Pairing, Reason, RequestShape
from control.routing import SpecStats
from control.services import convert
from dataplane.routestream import RouteStream, StreamBroken

log = logging.getLogger("baton.shim.oracle")


class ControlUnavailable(Exception):
    """Control did not answer in time; the message says why."""


@dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    backend_id: str
    model: str
    ok: bool
    http_status: int
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    reply_chain_hash: bytes = b""  # chat: the next turn's prefix, to pin where it was served
    message_count: int = 0
    spec: SpecStats | None = None


@dataclass(frozen=True, slots=True)
class FailoverReport:
    """How one choice's failover ended; becomes one audit event in control."""

    request_id: str
    from_backend: str
    to_backend: str
    failure: str
    choice: int
    tokens_sent: int
    path: str  # token | text | "" when no resume was attempted
    seam: str  # verified | divergent | unchecked | sampled | ""
    gap_ms: float
    attempt: int
    outcome: str  # resumed | failed (another attempt follows) | refused | exhausted
    detail: str = ""
    trace_id: str = ""


@dataclass(frozen=True, slots=True)
class GateAnswer:
    verdict: str  # accept | probation | reject
    reason: str
    target: Backend | None  # on reject: where the draft was re-bound (None: go target-only)


@dataclass(frozen=True, slots=True)
class FleetView:
    """The part of control's snapshot the shim serves locally (e.g. /v1/models)."""

    version: int = 0
    models: tuple[str, ...] = ()
    backends: tuple[Backend, ...] = field(default_factory=tuple)


class Oracle(Protocol):
    async def route(
        self, request_id: str, shape: RequestShape, traceparent: str = ""
    ) -> Decision: ...

    async def attempt_failed(
        self, request_id: str, backend_id: str, failure: str, detail: str
    ) -> None: ...

    def finished(self, outcome: Outcome) -> None: ...

    async def failover(
        self,
        request_id: str,
        shape: RequestShape,
        failed_backend_id: str,
        failure: str,
        exclude: Sequence[str],
        preferred: Sequence[str] = (),
        traceparent: str = "",
        pair_id: str = "",
    ) -> Decision: ...

    async def gate_pairing(
        self, request_id: str, pair_id: str, target_id: str, drafted: int, accepted: int
    ) -> GateAnswer: ...

    def report_failover(self, report: FailoverReport) -> None: ...

    @property
    def fleet(self) -> FleetView: ...


def _shape_to_pb(s: RequestShape) -> routing_pb2.RequestShape:
    return routing_pb2.RequestShape(
        model=s.model,
        message_count=s.message_count,
        prefix_chain=s.prefix_chain,
        assistant_turns=s.assistant_turns,
        prompt_chars=s.prompt_chars,
        greedy=s.greedy,
        stream=s.stream,
        spec_eligible=s.spec_eligible,
        sets_temperature=s.sets_temperature,
    )


REASON_FROM_PB = {v: k for k, v in convert.REASON_TO_PB.items()}
PATH_TO_PB = {v: k for k, v in convert.PATH_FROM_PB.items()}
SEAM_TO_PB = {v: k for k, v in convert.SEAM_FROM_PB.items()}
OUTCOME_TO_PB = {v: k for k, v in convert.FAILOVER_OUTCOME_FROM_PB.items()}


def _decision_from_pb(resp: routing_pb2.RouteResponse | routing_pb2.FailoverResponse) -> Decision:
    return Decision(
        tuple(convert.backend_from_pb(b) for b in resp.backends),
        REASON_FROM_PB.get(resp.reason, Reason.NO_BACKEND),
        resp.snapshot_version,
        resp.detail,
        _pairing_from_pb(resp.pairing) if resp.HasField("pairing") else None,
    )


def _pairing_from_pb(p: routing_pb2.SpecPairing) -> Pairing:
    return Pairing(
        p.pair_id,
        convert.backend_from_pb(p.draft),
        p.num_draft_tokens,
        p.params_hash,
        p.gate_required,
        p.eos_token_id if p.HasField("eos_token_id") else None,
    )


VERDICT_FROM_PB = {v: k.value for k, v in convert.VERDICT_TO_PB.items()}


def models_of(backends: Sequence[Backend]) -> tuple[str, ...]:
    return tuple(sorted({b.model for b in backends if b.serves_clients}))


def _spec_to_pb(s: SpecStats) -> routing_pb2.SpecOutcome:
    return routing_pb2.SpecOutcome(
        pair_id=s.pair_id,
        target_backend_id=s.target_id,
        rounds=s.rounds,
        drafted=s.drafted,
        accepted=s.accepted,
        repeated_ngram=s.repeated_ngram,
        schema_violation=s.schema_violation,
    )


class GrpcOracle:
    def __init__(
        self,
        target: str,
        *,
        route_timeout: float = 2.0,
        flush_interval: float = 0.05,
        max_buffered: int = 10_000,
    ) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = routing_pb2_grpc.RoutingServiceStub(self._channel)
        self._stream = RouteStream(self._stub, max_outcomes=max_buffered, timeout=route_timeout)
        self._timeout = route_timeout
        self._flush_interval = flush_interval
        self._fleet = FleetView()
        self._first_snapshot = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()

    @property
    def fleet(self) -> FleetView:
        return self._fleet

    @property
    def dropped_outcomes(self) -> int:
        return self._stream.dropped_outcomes

    async def start(self, wait_for_snapshot: float = 10.0) -> None:
        self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._flusher())]
        try:
            await asyncio.wait_for(self._first_snapshot.wait(), wait_for_snapshot)
        except TimeoutError:
            log.warning("no snapshot from control yet; serving /v1/models empty until it comes")

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self._stream.close()
        await self._channel.close()

    async def route(self, request_id: str, shape: RequestShape, traceparent: str = "") -> Decision:
        request = routing_pb2.RouteRequest(
            request_id=request_id, shape=_shape_to_pb(shape), traceparent=traceparent
        )
        return await self._decision(self._stream.route(request))

    async def _decision(self, answer: Awaitable[routing_pb2.RouteResponse]) -> Decision:
        """One answer from the RouteStream, with its failures in the oracle's terms."""
        try:
            resp = await answer
        except TimeoutError:
            raise ControlUnavailable(
                f"control plane did not answer within {self._timeout:g}s"
            ) from None
        except StreamBroken as exc:
            raise ControlUnavailable(f"control plane: {exc}") from None
        return _decision_from_pb(resp)

    async def attempt_failed(
        self, request_id: str, backend_id: str, failure: str, detail: str
    ) -> None:
        try:
            await self._stub.ReportAttemptFailure(
                routing_pb2.ReportAttemptFailureRequest(
                    request_id=request_id, backend_id=backend_id, failure=failure, detail=detail
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            # The retry proceeds regardless; the prober will demote the backend too.
            log.warning("could not report failure of %s: %s", backend_id, exc.code().name)

    async def failover(
        self,
        request_id: str,
        shape: RequestShape,
        failed_backend_id: str,
        failure: str,
        exclude: Sequence[str],
        preferred: Sequence[str] = (),
        traceparent: str = "",
        pair_id: str = "",
    ) -> Decision:
        request = routing_pb2.FailoverRequest(
            pair_id=pair_id,
            traceparent=traceparent,
            request_id=request_id,
            shape=_shape_to_pb(shape),
            failed_backend_id=failed_backend_id,
            failure=failure,
            exclude_backend_ids=list(exclude),
            preferred_backend_ids=list(preferred),
        )
        return await self._decision(self._stream.failover(request))

    async def gate_pairing(
        self, request_id: str, pair_id: str, target_id: str, drafted: int, accepted: int
    ) -> GateAnswer:
        try:
            resp = await self._stub.GatePairing(
                routing_pb2.GatePairingRequest(
                    request_id=request_id,
                    pair_id=pair_id,
                    target_backend_id=target_id,
                    drafted=drafted,
                    accepted=accepted,
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            raise ControlUnavailable(f"control plane: {exc.code().name}") from None
        target = convert.backend_from_pb(resp.target) if resp.HasField("target") else None
        return GateAnswer(VERDICT_FROM_PB.get(resp.verdict, "reject"), resp.reason, target)

    def report_failover(self, report: FailoverReport) -> None:
        task = asyncio.create_task(self._report_failover(report))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _report_failover(self, r: FailoverReport) -> None:
        try:
            await self._stub.ReportFailover(
                routing_pb2.ReportFailoverRequest(
                    request_id=r.request_id,
                    trace_id=r.trace_id,
                    from_backend_id=r.from_backend,
                    to_backend_id=r.to_backend,
                    failure=r.failure,
                    choice_index=r.choice,
                    tokens_sent=r.tokens_sent,
                    path=PATH_TO_PB.get(r.path, routing_pb2.RESUME_PATH_UNSPECIFIED),
                    seam=SEAM_TO_PB.get(r.seam, routing_pb2.SEAM_VERDICT_UNSPECIFIED),
                    gap_ms=r.gap_ms,
                    attempt=r.attempt,
                    outcome=OUTCOME_TO_PB[r.outcome],
                    detail=r.detail,
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not report failover of %s: %s", r.request_id, exc.code().name)

    def finished(self, outcome: Outcome) -> None:
        self._stream.report(
            routing_pb2.RequestOutcome(
                request_id=outcome.request_id,
                backend_id=outcome.backend_id,
                model=outcome.model,
                outcome=routing_pb2.OUTCOME_OK if outcome.ok else routing_pb2.OUTCOME_BACKEND_ERROR,
                http_status=outcome.http_status,
                ttft_ms=outcome.ttft_ms,
                total_ms=outcome.total_ms,
                reply_chain_hash=outcome.reply_chain_hash,
                message_count=outcome.message_count,
                spec=_spec_to_pb(outcome.spec) if outcome.spec is not None else None,
            )
        )

    async def _flusher(self) -> None:
        # Outcomes ride along with routes; this only matters when the shim goes idle.
        while True:
            await asyncio.sleep(self._flush_interval)
            self._stream.flush()

    async def _watch(self) -> None:
        after = 0
        while True:
            try:
                stream = self._stub.WatchSnapshots(
                    routing_pb2.WatchSnapshotsRequest(after_version=after)
                )
                async for msg in stream:
                    snap = msg.snapshot
                    after = snap.version
                    backends = tuple(convert.backend_from_pb(b.backend) for b in snap.backends)
                    self._fleet = FleetView(snap.version, models_of(backends), backends)
                    self._first_snapshot.set()
            except grpc.aio.AioRpcError as exc:
                log.debug("snapshot watch: %s; reconnecting", exc.code().name)
            # Control restarts start versions again from 1: accept whatever it sends next.
            after = 0
            await asyncio.sleep(0.5)
