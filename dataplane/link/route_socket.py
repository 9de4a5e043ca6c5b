"""The shim's end of control's route socket (proto/baton/v1/routing.proto, RouteSocketHello):
RouteStream's messages over one plain TCP connection, TLS when control's gRPC is.

A carrier for dataplane/link/routestream.py: it connects and says hello, sends each batch
with one write (no await unless control has stopped reading), and hands each answer's
results to `deliver` inside data_received: no task and no thread between the bytes and the
waiting request."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from typing import cast

from google.protobuf.message import DecodeError

from baton.frames import Deframer, FrameError, frame
from baton.v1 import routing_pb2
from dataplane.exceptions import ControlRefused, StreamBroken

SCHEMES = ("unix", "unix-abstract", "vsock", "dns", "ipv4", "ipv6")
Deliver = Callable[[Sequence[routing_pb2.RouteResult]], None]


def split_target(target: str) -> tuple[str, int] | None:
    """(host, port) of a plain `HOST:PORT` (or `[V6]:PORT`) gRPC target; None for a target
    with a scheme (`dns:///`, `unix:`, `ipv4:` ...), which the shim leaves to gRPC."""
    if target.startswith("["):
        host, sep, port = target[1:].partition("]:")
    else:
        host, sep, port = target.rpartition(":")
        if ":" in host or "/" in host:
            return None
    if not (sep and host and port.isdigit()) or host in SCHEMES:
        return None
    return host, int(port)


class SocketCall(asyncio.Protocol):
    """One open route socket. `closed(self, reason)` is told once, when it ends for any
    reason other than cancel()."""

    def __init__(self, deliver: Deliver, closed: Callable[[SocketCall, str], None]) -> None:
        self._deliver = deliver
        self._closed = closed
        self._deframer = Deframer()
        self._transport: asyncio.Transport | None = None
        self._welcome: asyncio.Future[routing_pb2.RouteSocketWelcome] = (
            asyncio.get_running_loop().create_future()
        )
        self._writable = asyncio.Event()
        self._writable.set()
        self._gone = asyncio.Event()
        self._cancelled = False

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        authorization: str,
        tls_ca: bytes | None,
        timeout: float,
        deliver: Deliver,
        closed: Callable[[SocketCall, str], None],
    ) -> SocketCall:
        """Connected and welcomed, within `timeout`. Raises OSError or TimeoutError when
        control can't be reached there, ControlRefused when it refuses this shim."""
        loop = asyncio.get_running_loop()
        context = ssl.create_default_context(cadata=tls_ca.decode()) if tls_ca else None
        async with asyncio.timeout(timeout):
            _, call = await loop.create_connection(
                lambda: cls(deliver, closed), host, port, ssl=context
            )
            try:
                call._send_now(routing_pb2.RouteSocketHello(authorization=authorization))
                welcome = await call._welcome
            except BaseException:
                call.cancel()
                raise
        if welcome.refused:
            call.cancel()
            raise ControlRefused(f"control refused this shim's route socket: {welcome.refused}")
        return call

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but are one in kind.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            bodies = self._deframer.feed(data)
            for body in bodies:
                if not self._welcome.done():
                    self._welcome.set_result(routing_pb2.RouteSocketWelcome.FromString(body))
                    continue
                self._deliver(routing_pb2.RouteStreamResponse.FromString(body).results)
        except (FrameError, DecodeError) as exc:
            self._end(f"route socket: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._writable.set()  # a send waiting for room finds the call gone
        self._gone.set()
        if not self._welcome.done():
            self._welcome.set_exception(
                ConnectionError(f"route socket closed before its welcome: {exc or 'EOF'}")
            )
        if not self._cancelled:
            self._cancelled = True
            self._closed(self, f"route socket closed by control: {exc or 'EOF'}")

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- RouteStream's carrier -----------------------------------------------------------

    async def send(self, msg: routing_pb2.RouteStreamRequest) -> None:
        """Written at once; waits only while control is not reading (its socket buffer
        full), so that batches queue in RouteStream, not in the kernel."""
        if not self._writable.is_set():
            await self._writable.wait()
        self._send_now(msg)

    def _send_now(self, msg: routing_pb2.RouteStreamRequest | routing_pb2.RouteSocketHello) -> None:
        if self._transport is None or self._transport.is_closing():
            raise StreamBroken("route socket closed")
        self._transport.write(frame(msg))

    async def finish(self, timeout: float) -> None:
        """Close once what was written has gone out (the last outcomes), within `timeout`."""
        self._cancelled = True
        if self._transport is not None:
            self._transport.close()
            try:
                async with asyncio.timeout(timeout):
                    await self._gone.wait()
            except TimeoutError:
                self.cancel()

    def cancel(self) -> None:
        self._cancelled = True
        if self._transport is not None:
            self._transport.abort()

    def _end(self, reason: str) -> None:
        if self._transport is not None:
            self._transport.abort()
        if not self._cancelled:
            self._cancelled = True
            self._closed(self, reason)
