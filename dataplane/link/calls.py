"""The shim's unary calls to control that a request waits for: a new pairing's gate verdict
(speculative decoding) and a stored response's owner (Responses API). Each fails fast while
control is known to be unreachable, and a transient failure or a replica's "not the leader"
refusal marks it so (the link's Leader then watches for its return, or finds the leader)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import grpc

from baton import wire
from baton.model import Verdict
from baton.v1 import routing_pb2, routing_pb2_grpc
from dataplane.exceptions import ControlUnavailable
from dataplane.link.needs import GateAnswer
from dataplane.link.outbox import TRANSIENT, not_leader


class Control(Protocol):
    """The replica a call goes to, and where its failure is told (dataplane/link/leader.py's
    Leader, which alone knows who leads)."""

    up: asyncio.Event  # set while control is believed reachable

    @property
    def stub(self) -> routing_pb2_grpc.RoutingServiceAsyncStub: ...

    def unreachable(self, reason: str, leader: str = "", via: object = None) -> None: ...


class Calls:
    def __init__(
        self, control: Control, metadata: Sequence[tuple[str, str]], timeout: float
    ) -> None:
        self._control = control
        self._metadata = tuple(metadata)
        self._timeout = timeout

    def _failed(self, what: str, exc: grpc.aio.AioRpcError, stub: object) -> ControlUnavailable:
        """Control marked away when `exc` says it is (the Leader ignores it when `stub` is a
        replica the link has left since); what the caller raises."""
        leader = not_leader(exc)
        if exc.code() in TRANSIENT or leader is not None:
            self._control.unreachable(f"{what}: {exc.code().name}", leader or "", stub)
        return ControlUnavailable(f"control plane: {exc.code().name}")

    async def gate_pairing(
        self, request_id: str, pair_id: str, target_id: str, drafted: int, accepted: int
    ) -> GateAnswer:
        if not self._control.up.is_set():
            raise ControlUnavailable("control plane unreachable")
        stub = self._control.stub
        try:
            resp = await stub.GatePairing(
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
            raise self._failed("gate", exc, stub) from None
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
        if not self._control.up.is_set():
            raise ControlUnavailable("control plane unreachable")
        request = routing_pb2.RecordOwnershipRequest(
            key=key, backend_id=backend_id, model=model, released=released, request_id=request_id
        )
        stub = self._control.stub
        try:
            await stub.RecordOwnership(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._failed("ownership", exc, stub) from None
