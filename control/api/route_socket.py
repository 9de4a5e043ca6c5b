"""Control's route socket: RouteStream's messages over plain TCP (proto/baton/v1/routing.proto,
RouteSocketHello). The shims' hot path: every request's route and outcome comes this way.

Why not gRPC: on grpc.aio a message costs each end its C core, a thread hop and a completion
queue turn, which measured most of a route's cost (docs/benchmarks.md#where-the-time-goes).
Here a message is parsed and answered inside the protocol's data_received, on the loop that
owns the router: no task, no thread and no copy between the bytes and the decision."""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import cast

from google.protobuf.message import DecodeError

from baton.frames import MAX_FRAME, MAX_HELLO, Deframer, FrameError, frame
from baton.tokens import SHIM_ENV
from baton.v1 import routing_pb2
from control.exceptions import NotLeader

log = logging.getLogger("baton.control.route_socket")

HELLO_SECONDS = 10.0  # from connecting to a hello

# (a message, where a later answer to it goes) -> the answer now, if any.
Answer = Callable[
    [routing_pb2.RouteStreamRequest, Callable[[routing_pb2.RouteStreamResponse], None]],
    "routing_pb2.RouteStreamResponse | None",
]


class _Shim(asyncio.Protocol):
    """One shim's connection: a hello, then routes and outcomes answered in order."""

    def __init__(
        self, answer: Answer, expected: bytes | None, conns: set[_Shim], hello_within: float
    ) -> None:
        self._answer = answer
        self._hello_within = hello_within
        self._expected = expected  # b"Bearer <token>", or None: the routing service is open
        self._conns = conns
        self._deframer = Deframer(MAX_HELLO)
        self._welcomed = False
        self._transport: asyncio.Transport | None = None
        self._hello_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but are one in kind.
        self._transport = cast(asyncio.Transport, transport)
        self._conns.add(self)
        # A peer that never says hello does not keep a connection (and its buffer) forever.
        self._hello_due = asyncio.get_running_loop().call_later(self._hello_within, self._no_hello)

    def _no_hello(self) -> None:
        if not self._welcomed and self._transport is not None:
            log.warning("route socket: no hello from %s within %gs: closing it",
                        self._peer(), self._hello_within)  # fmt: skip
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._conns.discard(self)
        self._transport = None
        if self._hello_due is not None:
            self._hello_due.cancel()

    # The shim reads as fast as control answers; if it stops, stop reading it too, so that
    # answers never pile up in control's memory.
    def pause_writing(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None:
            return
        try:
            for body in self._deframer.feed(data):
                if not self._welcomed:
                    self._hello(body)
                    if not self._welcomed:
                        return
                    continue
                answer = self._answer(routing_pb2.RouteStreamRequest.FromString(body), self._later)
                if answer is not None:
                    transport.write(frame(answer))
        except (FrameError, DecodeError) as exc:
            log.warning("route socket: %s from %s: closing it", exc, self._peer())
            transport.abort()
        except NotLeader:
            # This replica stopped leading: the shim routes from its snapshot while it finds
            # the new leader.
            transport.abort()
        except Exception:
            # A decision that raised: the shim's questions on this socket fail at once (it
            # routes from its snapshot until control answers again), and control goes on.
            log.exception("route socket: answering %s failed: closing it", self._peer())
            transport.abort()

    def _later(self, answer: routing_pb2.RouteStreamResponse) -> None:
        """A queued request's answer, when its turn comes (nothing if the shim is gone)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(answer))

    def _hello(self, body: bytes) -> None:
        assert self._transport is not None
        hello = routing_pb2.RouteSocketHello.FromString(body)
        given = hello.authorization.encode()
        if self._expected is not None and not hmac.compare_digest(given, self._expected):
            refused = (
                f"shim token missing or wrong: only shims may use the route socket; give the "
                f"shim control's token ({SHIM_ENV} or --shim-token-file)"
            )
            self._transport.write(frame(routing_pb2.RouteSocketWelcome(refused=refused)))
            self._transport.close()  # after the refusal is written
            return
        self._welcomed = True
        self._deframer.limit = MAX_FRAME
        self._transport.write(frame(routing_pb2.RouteSocketWelcome()))

    def _peer(self) -> str:
        peer = self._transport.get_extra_info("peername") if self._transport else None
        return f"{peer[0]}:{peer[1]}" if peer else "a peer"

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class RouteSocket:
    """The listening socket; `start` binds (port 0: any free one) and says which port."""

    def __init__(
        self,
        answer: Answer,
        shim_token: str | None,
        tls: tuple[bytes, bytes] | None = None,
        *,
        hello_within: float = HELLO_SECONDS,
    ) -> None:
        self._answer = answer
        self._hello_within = hello_within
        self._expected = f"Bearer {shim_token}".encode() if shim_token else None
        self._tls = tls
        self._server: asyncio.Server | None = None
        self._conns: set[_Shim] = set()

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Shim(self._answer, self._expected, self._conns, self._hello_within),
            host or None,
            port,
            ssl=self._ssl(),
        )
        return int(self._server.sockets[0].getsockname()[1])

    def _ssl(self) -> ssl.SSLContext | None:
        if self._tls is None:
            return None
        cert, key = self._tls
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        # load_cert_chain reads files only: the PEMs live in a private directory just as long
        # as it takes to read them.
        with tempfile.TemporaryDirectory() as tmp:
            chain, secret = Path(tmp) / "chain.pem", Path(tmp) / "key.pem"
            chain.write_bytes(cert)
            secret.write_bytes(key)
            ctx.load_cert_chain(chain, secret)
        return ctx

    def drop_all(self) -> None:
        """Closes every shim's connection (this replica stopped leading)."""
        for conn in list(self._conns):
            conn.close()

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self._conns):
            conn.close()
        await self._server.wait_closed()
        self._server = None
