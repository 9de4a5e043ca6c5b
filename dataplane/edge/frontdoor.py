"""The shim's front door: a small process of its own that owns the listening socket (the why:
dataplane/edge/health.py). It accepts each connection, looks at its first bytes without taking them
(MSG_PEEK), answers a health probe itself from the shim's state block, and passes any other
connection, bytes untouched, to the shim over a Unix socket (SCM_RIGHTS), where the event
loop's HTTP server serves it as if it had accepted it.

Bounded: a connection that has not said what it is within WAIT_S, or whose head outgrows
MAX_HEAD, goes to the shim as it is, whose own limits and timeouts then apply. The front door
exits when the shim closes its end of the Unix socket, or dies (PR_SET_PDEATHSIG), and with
it the listener: then nothing listens on the port.

`python -m dataplane.edge.frontdoor LISTEN_FD PASS_FD STATE_FD`, started by Door.spawn()."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import logging
import mmap
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from dataplane.edge.health import BLOCK_SIZE, HEARTBEAT_S, PATHS, View, answer

log = logging.getLogger("baton.shim.frontdoor")

WAIT_S = 10.0
MAX_HEAD = 8192
START_S = 30.0  # a cold interpreter on a busy machine
RECHECK_S = 0.005  # how soon a connection that said too little yet is looked at again
_METHODS = (b"GET ", b"HEAD ")
_REASONS = {200: "OK", 503: "Service Unavailable"}
_PR_SET_PDEATHSIG = 1


class Head(StrEnum):
    """What the first bytes of a connection are."""

    HEALTH = "health"  # a whole probe request head: the front door answers it
    WAIT = "wait"  # may still become one: look again when more has come
    OTHER = "other"  # anything else: the shim's


def classify(data: bytes) -> tuple[Head, int, str, bool]:
    """(what the first bytes of a connection are, the head's length, the path, HEAD?)."""
    method = next((m for m in _METHODS if data.startswith(m)), None)
    if method is None:
        may = any(m.startswith(data) for m in _METHODS)
        return (Head.WAIT if may else Head.OTHER), 0, "", False
    line_end = data.find(b"\r\n")
    target = data[len(method) : line_end if line_end >= 0 else len(data)]
    path = target.split(b" ", 1)[0].split(b"?", 1)[0]
    if line_end < 0:  # the request line is still arriving
        if len(data) >= MAX_HEAD:
            return Head.OTHER, 0, "", False
        ours = [p.encode() for p in PATHS]
        whole = b" " in target  # the path has ended
        maybe = path in ours if whole else any(p.startswith(path) for p in ours)
        return (Head.WAIT if maybe else Head.OTHER), 0, "", False
    name = path.decode("latin-1")
    if name not in PATHS:
        return Head.OTHER, 0, "", False
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return (Head.WAIT if len(data) < MAX_HEAD else Head.OTHER), 0, "", False
    return Head.HEALTH, head_end + 4, name, method == b"HEAD "


def response(status: int, body: bytes, head_only: bool) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
        f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


# -- the front door's own process ----------------------------------------------------------


class _Door:
    def __init__(self, listener: socket.socket, shim: socket.socket, state: mmap.mmap) -> None:
        self._listener = listener
        self._shim = shim
        self._state = state
        self._sel = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, float] = {}  # undecided connections -> deadline
        # Undecided ones that said too little yet, out of the selector until a recheck: what
        # they sent stays unread (peeked), so the selector would call them ready at once,
        # again and again, and the door would spin.
        self._parked: dict[socket.socket, float] = {}
        self._outbox: collections.deque[socket.socket] = collections.deque()
        self._open = True

    def run(self) -> None:
        self._shim.sendall(b"r")  # up: the shim says READY only after this
        for sock in (self._listener, self._shim):
            sock.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._shim, selectors.EVENT_READ)
        while self._open:
            timeout = 0.5
            if self._parked:
                timeout = max(0.0, min(0.5, min(self._parked.values()) - time.monotonic()))
            for key, events in self._sel.select(timeout=timeout):
                fileobj = key.fileobj
                assert isinstance(fileobj, socket.socket)  # noqa: S101 - only sockets here
                sock = fileobj
                if sock is self._listener:
                    self._accept()
                elif sock is self._shim:
                    self._shim_ready(events)
                else:
                    self._look(sock)
            now = time.monotonic()
            for sock in [s for s, due in self._parked.items() if due <= now]:
                del self._parked[sock]
                self._sel.register(sock, selectors.EVENT_READ)  # look again
            for sock in [s for s, due in self._waiting.items() if due <= now]:
                self._pass(sock)

    def _accept(self) -> None:
        for _ in range(256):  # a burst at a time
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the next select retries
                log.warning("accept: %s", exc)
                return
            conn.setblocking(False)
            self._waiting[conn] = time.monotonic() + WAIT_S
            self._sel.register(conn, selectors.EVENT_READ)

    def _look(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(MAX_HEAD, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client left before saying anything
            self._forget(sock)
            sock.close()
            return
        kind, head, path, head_only = classify(data)
        if kind is Head.WAIT:
            self._sel.unregister(sock)
            self._parked[sock] = time.monotonic() + RECHECK_S
            return
        if kind is Head.OTHER:
            self._pass(sock)
            return
        self._forget(sock)
        reply = answer(path, View.unpack(self._state[:BLOCK_SIZE]), time.monotonic())
        with contextlib.suppress(OSError):
            sock.recv(head)  # the probe's head, so closing sends no reset over the answer
            sock.send(response(reply.status, reply.body, head_only))
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def _forget(self, sock: socket.socket) -> None:
        if self._parked.pop(sock, None) is None:
            self._sel.unregister(sock)
        del self._waiting[sock]

    def _pass(self, sock: socket.socket) -> None:
        self._forget(sock)
        self._outbox.append(sock)
        self._flush()

    def _flush(self) -> None:
        while self._outbox:
            sock = self._outbox[0]
            try:
                socket.send_fds(self._shim, [b"c"], [sock.fileno()])
            except (BlockingIOError, InterruptedError):
                self._sel.modify(self._shim, selectors.EVENT_READ | selectors.EVENT_WRITE)
                return
            except OSError:  # the shim is gone
                self._open = False
                return
            self._outbox.popleft()
            sock.close()  # the shim holds its own copy now
        self._sel.modify(self._shim, selectors.EVENT_READ)

    def _shim_ready(self, events: int) -> None:
        if events & selectors.EVENT_READ:
            try:
                if not self._shim.recv(64):
                    self._open = False  # the shim closed its end: stop
                    return
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._open = False
                return
        if events & selectors.EVENT_WRITE:
            self._flush()


def main(argv: list[str]) -> int:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    listen_fd, pass_fd, state_fd, shim_pid = (int(a) for a in argv)
    # The shim died before the death signal was set. Compared with the shim's pid, not 1: in
    # a container the shim is pid 1 itself.
    if os.getppid() != shim_pid:
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the shim decides when the door closes
    listener = socket.socket(fileno=listen_fd)
    shim = socket.socket(fileno=pass_fd)
    state = mmap.mmap(state_fd, BLOCK_SIZE, access=mmap.ACCESS_READ)
    try:
        _Door(listener, shim, state).run()
    finally:
        listener.close()
    return 0


# -- the shim's side ------------------------------------------------------------------------


class Door:
    """The shim's handle on its front door: the process, the state block it reads, and the
    connections it passes (served by `server` on the running loop)."""

    def __init__(
        self,
        listener: socket.socket,
        view: Callable[[], View],
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_lost`: called if the front door exits on its own (the port is closed then,
        so the shim should stop: its streams finish, and a supervisor starts a new one)."""
        self._on_lost = on_lost
        self._closing = False
        self._listener = listener
        self._server: Any = None  # the HTTP server connections go to (serve())
        self._view = view
        self._memfd = os.memfd_create("baton-shim-health")
        os.ftruncate(self._memfd, BLOCK_SIZE)
        self._state = mmap.mmap(self._memfd, BLOCK_SIZE)
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc: subprocess.Popen[bytes] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._adopting: set[asyncio.Future[Any]] = set()

    async def spawn(self, timeout: float = START_S) -> None:
        """Start the front door (the listener is its from now on) and the heartbeat; returns
        once it is up (a connection that came before would wait for its start, ~0.1 s).
        Raises RuntimeError if it does not come up. Called before the shim opens its gRPC
        channel: a fork beside gRPC's threads can abort in the child."""
        self.write()
        fds = (self._listener.fileno(), self._theirs.fileno(), self._memfd)
        # On this thread, the loop's: the front door's death signal follows the thread that
        # forked it, which must live as long as the shim.
        self._proc = subprocess.Popen(  # noqa: ASYNC220 - a fork, not a wait
            [sys.executable, "-m", "dataplane.edge.frontdoor", *map(str, fds), str(os.getpid())],
            pass_fds=fds,
        )
        self._theirs.close()
        self._listener.close()  # the front door's alone: it closes when the door does
        loop = asyncio.get_running_loop()
        self._ours.setblocking(False)
        try:
            up = await asyncio.wait_for(loop.sock_recv(self._ours, 1), timeout)
        except TimeoutError:
            up = b""
        if up != b"r":
            raise RuntimeError(f"the front door did not start within {timeout} s")
        self._beat = asyncio.create_task(self._heartbeat())

    def serve(self, server: Any) -> None:
        """From now on the connections the front door passes go to `server` (aiohttp's
        web.Server, a protocol factory); until then they wait in the Unix socket."""
        self._server = server
        asyncio.get_running_loop().add_reader(self._ours.fileno(), self._receive)

    def write(self) -> None:
        """The state block as it is now (also at once on a drain)."""
        self._state[:BLOCK_SIZE] = self._view().pack()

    async def _heartbeat(self) -> None:
        while True:
            try:
                self.write()
            except Exception:
                # A block left as it was would say the shim is wedged (then dead) while it
                # serves: say why, and beat on.
                log.exception("writing the front door's state block failed")
            await asyncio.sleep(HEARTBEAT_S)

    def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(64):
            try:
                msg, fds, _, _ = socket.recv_fds(self._ours, 64, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds = b"", []
            if not msg:
                loop.remove_reader(self._ours.fileno())  # the front door is gone
                if not self._closing:
                    log.error("the front door exited: no new connections reach this shim")
                    self._on_lost()
                return
            for fd in fds:
                sock = socket.socket(fileno=fd)
                task = asyncio.ensure_future(loop.connect_accepted_socket(self._server, sock))
                self._adopting.add(task)
                task.add_done_callback(functools.partial(self._adopted, sock=sock))

    def _adopted(self, task: asyncio.Future[Any], *, sock: socket.socket) -> None:
        self._adopting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("connection not served: %s", task.exception())
            sock.close()

    async def close(self) -> None:
        """Close the door: the front door process exits and the port stops listening."""
        self._closing = True
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._ours.fileno())
        self._ours.close()
        if self._proc is not None:
            try:
                await asyncio.to_thread(self._proc.wait, 5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait, 5)
        self._state.close()
        os.close(self._memfd)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
