"""Which control replica the shim's link talks to, and whether it answers: `Leader`.

Its own module because it is the one place that knows who leads. Every call the link makes
reads `Leader.stub` when it goes, and a failed call tells `Leader.unreachable` which stub it
used: a failure of a replica the link has left since says nothing of the one it talks to now,
and that is decided here alone. Only what holds something open at a replica (the RouteStream,
the snapshot watch) is told of a move, through `on_move`.

Control is away when a call fails for a transient reason or a replica refuses as "not the
leader" (dataplane/link/targets.py); then a probe asks the addresses' health services (the
leader a refusal named first) until one says RoutingService is SERVING, moves there when it is
not the one talked to, and says control is back (`up`). One address is today's single control:
nothing else is asked, nothing costs more. Each address's channel is opened when first needed
and kept (a replica the link leaves may lead again)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from baton.replicas import split_targets
from baton.v1 import routing_pb2, routing_pb2_grpc
from dataplane.link.route_socket import split_target
from dataplane.link.targets import probe_order

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
class Target:
    """One control address, its channel and what the link calls there."""

    address: str
    channel: grpc.aio.Channel
    stub: routing_pb2_grpc.RoutingServiceAsyncStub
    health: HealthCheck  # grpc.health.v1 Check, served next to RoutingService (no token)
    # Where its route socket listens (None: an address with a scheme, routed over gRPC).
    host: str | None

    @classmethod
    def open(cls, address: str, tls_ca: bytes | None) -> Target:
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


class Leader:
    def __init__(
        self,
        target: str,
        *,
        tls_ca: bytes | None,
        timeout: float,
        probe_interval: float,
        on_down: Callable[[str], None],
        on_move: Callable[[Target], None],
        on_back: Callable[[Target, Target, float], None],
    ) -> None:
        """`target`: control's HOST:PORT, or its replicas' as A,B,C. `timeout` bounds each
        health check; the probe asks again every `probe_interval` (or at once on `poke`).
        `on_down(reason)`: control just went away. `on_move(to)`: the link talks to `to`
        from now on. `on_back(was, now, seconds away)`: control answers again, `up` is set."""
        self._addresses = split_targets(target)
        self._tls_ca = tls_ca
        self._timeout = timeout
        self._probe_interval = probe_interval
        self._on_down, self._on_move, self._on_back = on_down, on_move, on_back
        first = Target.open(self._addresses[0], tls_ca)
        self._targets = {first.address: first}  # each opened when first asked, then kept
        self._at = first  # the one talked to: the leader, as far as the link knows
        self._hint = ""  # the leader a refusal named: the probe asks it first
        self.up = asyncio.Event()  # set while control is believed reachable
        self.up.set()
        self._down_since = 0.0
        self._poke = asyncio.Event()  # a snapshot arrived: probe control now
        self._prober: asyncio.Task[None] | None = None
        self._closing = False
        self.outages = 0

    @property
    def at(self) -> Target:
        return self._at

    @property
    def stub(self) -> routing_pb2_grpc.RoutingServiceAsyncStub:
        """The leader's, as far as the link knows: read by every call when it is made."""
        return self._at.stub

    @property
    def several(self) -> bool:
        """Whether there are replicas to choose from (else: one control, nothing to find)."""
        return len(self._addresses) > 1

    def poke(self) -> None:
        """Something was heard from control: a probe under way asks again now."""
        self._poke.set()

    def unreachable(self, reason: str, leader: str = "", via: object = None) -> None:
        """Control is away: probe until it answers. `leader`: the leader a "not the leader"
        refusal named. `via`: the stub the failed call used; a failure of a replica the link
        has left since says nothing of the one it talks to."""
        if via is not None and via is not self.stub:
            return
        if leader:
            self._hint = leader
        if not self.up.is_set() or self._closing:
            return
        self.up.clear()
        self.outages += 1
        self._down_since = time.monotonic()
        self._on_down(reason)
        self._prober = asyncio.create_task(self._probe())

    def closing(self) -> None:
        """The link is closing: calls failing from now on are its doing, not an outage."""
        self._closing = True

    async def stop(self) -> None:
        """No more probing (the channels stay open for what is still closing)."""
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober

    async def close(self) -> None:
        await self.stop()
        for target in self._targets.values():
            await target.channel.close()

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
            self._at = found
            self._on_move(found)
        self._hint = ""
        self.up.set()
        self._on_back(was, found, time.monotonic() - self._down_since)

    async def _find_serving(self) -> Target | None:
        """The first address, in probe order, whose health says RoutingService is SERVING
        (a replica that does not lead says NOT_SERVING). All are asked at once: a hung one
        costs one timeout, not one each."""
        addresses = probe_order(self._addresses, self._at.address, self._hint)
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

    async def _serving(self, target: Target) -> bool:
        request = health_pb2.HealthCheckRequest(service=ROUTING_SERVICE)
        try:
            resp = await target.health(request, timeout=self._timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == SERVING)

    def _target(self, address: str) -> Target:
        if (target := self._targets.get(address)) is None:
            target = self._targets[address] = Target.open(address, self._tls_ca)
        return target
