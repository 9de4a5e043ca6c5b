"""The shim's unary calls to control that a request waits for: a new pairing's gate verdict
(speculative decoding) and a stored response's owner (Responses API). Each fails fast while
control is known to be unreachable, and a transient failure marks it so (ControlLink's
probe then watches for its return)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from baton import wire
from baton.model import Verdict
from baton.v1 import routing_pb2, routing_pb2_grpc
from dataplane.exceptions import ControlUnavailable
from dataplane.link.needs import GateAnswer
from dataplane.link.outbox import TRANSIENT


class Calls:
    def __init__(
        self,
        stub: routing_pb2_grpc.RoutingServiceAsyncStub,
        metadata: Sequence[tuple[str, str]],
        timeout: float,
        up: asyncio.Event,
        unreachable: Callable[[str], None],
    ) -> None:
        self._stub = stub
        self._metadata = tuple(metadata)
        self._timeout = timeout
        self._up = up
        self._unreachable = unreachable

    async def gate_pairing(
        self, request_id: str, pair_id: str, target_id: str, drafted: int, accepted: int
    ) -> GateAnswer:
        if not self._up.is_set():
            raise ControlUnavailable("control plane unreachable")
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
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in TRANSIENT:
                self._unreachable(f"gate: {exc.code().name}")
            raise ControlUnavailable(f"control plane: {exc.code().name}") from None
        target = wire.backend_from_pb(resp.target) if resp.HasField("target") else None
        # A verdict this shim does not know is no permission to serve: fail closed.
        verdict = wire.VERDICT_FROM_PB.get(resp.verdict, Verdict.REJECT)
        return GateAnswer(verdict, resp.reason, target)

    async def record_owner(
        self, request_id: str, key: str, backend_id: str, model: str, *, released: bool = False
    ) -> None:
        """Waits for control's answer: the client must not learn `key` before control knows
        where it lives, or a follow-up through another shim could arrive first. Raises
        ControlUnavailable (the answer goes out anyway; the follow-up will be refused)."""
        if not self._up.is_set():
            raise ControlUnavailable("control plane unreachable")
        request = routing_pb2.RecordOwnershipRequest(
            key=key, backend_id=backend_id, model=model, released=released, request_id=request_id
        )
        try:
            await self._stub.RecordOwnership(
                request, timeout=self._timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in TRANSIENT:
                self._unreachable(f"ownership: {exc.code().name}")
            raise ControlUnavailable(f"control plane: {exc.code().name}") from None
