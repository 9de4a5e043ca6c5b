"""What the kernel may buffer for one stream on each side of the shim.

Left to itself, Linux autotunes a socket's buffers up to tcp_wmem/tcp_rmem's maximum (4 and
6-32 MiB by default). For a client that stops reading, that is megabytes of SSE queued in
the kernel for one stream before the relay's write waits, and every token of it is one
whose id and text the shim holds for a resume (bench.memory's stalled case: 1.4 MiB of the
shim a stalled stream, 0.4 with these caps; the floor proxy's 0.7). A token stream needs
little: 64 KiB is hundreds of events, and keeps a 100 ms client link at over 600 KB/s."""

from __future__ import annotations

import contextlib
import socket
from typing import Any


def cap(transport: Any, option: int, size: int) -> None:
    """Sets the transport's socket `option` (SO_SNDBUF or SO_RCVBUF) to `size` bytes as the
    kernel counts them (it doubles what it is given, for its bookkeeping); nothing when
    size is 0 or the transport has no socket."""
    if size <= 0 or transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # A socket already closed, or one that is not TCP: then nothing to cap.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, max(size // 2, 4096))


def cap_client(transport: Any, size: int) -> None:
    """The client's connection, once its stream begins: what it may have unread."""
    cap(transport, socket.SO_SNDBUF, size)


def cap_engine(transport: Any, size: int) -> None:
    """An engine's connection, once its stream begins: what it may send ahead of the relay."""
    cap(transport, socket.SO_RCVBUF, size)


def read_bufsize(size: int) -> int:
    """aiohttp's read_bufsize for the engines' session: it stops reading a response once
    twice this is buffered unread."""
    return max(size // 2, 16 * 1024) if size > 0 else 2**16
