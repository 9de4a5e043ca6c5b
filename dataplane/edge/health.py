"""Liveness and readiness of one shim process, answered where traffic cannot starve them.

Why not the event loop, nor a thread beside it: under a storm the loop is busy relaying the
streams it admitted (and refusing the rest), and a probe queued behind that work waited up
to 1.5 s, past Kubernetes' 1 s default: an orchestrator would kill a shim for being busy and
cut every stream it carried. A thread of the shim's own does no better (bench.storm on 2
cores: p99 ~180 ms for both): to answer, it needs the interpreter lock, which the loop's
thread holds while the kernel has it descheduled among the busy processes. So a small
process of its own, the front door (dataplane/edge/frontdoor.py), owns the listening socket: it
answers the probes from the state block below and passes every other connection to the shim. A
mostly idle process is scheduled at once when it wakes (the same bench: p99 ~11 ms for a bare one).

- `GET /health/live` and `GET /health` (today's users): 200 while the shim's event loop turns
  (it stamps a heartbeat every HEARTBEAT_S), drain included: only a dead or wedged shim
  should be restarted. 503 once the heartbeat is older than STALLED_S.
- `GET /health/ready`: 503 with the reason while this shim should get no new work: at its
  in-flight cap, draining (SIGTERM, until it exits), or cut off from control with no snapshot
  to route from; 200 otherwise. A load balancer then stops sending work and nobody kills the
  process.

The state block is a few numbers in shared memory, written by the shim's loop (frontdoor.Door.write)
and read by the front door: a probe needs no more than a moment's truth."""

# baton: pure

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

LIVE_PATHS = frozenset({"/health", "/health/live"})
READY_PATH = "/health/ready"
PATHS = LIVE_PATHS | {READY_PATH}
HEARTBEAT_S = 0.05  # how often the shim writes the block (readiness is this fresh)
STALLED_S = 10.0  # a loop that has not turned for this long is wedged, not busy

# heartbeat (CLOCK_MONOTONIC, system-wide), in flight, cap, draining, routable
_LAYOUT = struct.Struct("<dqqqq")
BLOCK_SIZE = _LAYOUT.size


@dataclass(frozen=True, slots=True)
class View:
    heartbeat: float
    in_flight: int
    cap: int
    draining: bool
    routable: bool

    def pack(self) -> bytes:
        return _LAYOUT.pack(
            self.heartbeat, self.in_flight, self.cap, int(self.draining), int(self.routable)
        )

    @classmethod
    def unpack(cls, data: bytes) -> View:
        beat, in_flight, cap, draining, routable = _LAYOUT.unpack(data[:BLOCK_SIZE])
        return cls(beat, in_flight, cap, bool(draining), bool(routable))


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes


def not_ready(view: View) -> str:
    """Why this shim should get no new work now; "" when it should."""
    if view.draining:
        return "draining"
    if view.in_flight >= view.cap:
        return f"at its in-flight cap ({view.cap})"
    if not view.routable:
        return "cut off from control with no snapshot to route from"
    return ""


def answer(path: str, view: View, now: float) -> Answer:
    """The probe at `path` (one of PATHS) for a shim in state `view` at monotonic `now`."""
    stalled = now - view.heartbeat
    if stalled > STALLED_S:
        return Answer(503, f"not live: the event loop has not turned for {stalled:.0f} s".encode())
    if path in LIVE_PATHS:
        return Answer(200, b"ok")
    why = not_ready(view)
    if why:
        return Answer(503, f"not ready: {why}".encode())
    return Answer(200, b"ready")


class Health:
    """The shim's own side of the state block: what its loop knows, as a View. `in_flight`
    and `routable` are read when a View is taken; `draining` is set by the drain."""

    def __init__(
        self,
        in_flight: Callable[[], int],
        cap: int,
        routable: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        self._in_flight = in_flight
        self._cap = cap
        self._routable = routable
        self._clock = clock
        self.draining = False

    def view(self) -> View:
        return View(self._clock(), self._in_flight(), self._cap, self.draining, self._routable())

    def answer(self, path: str) -> Answer:
        return answer(path, self.view(), self._clock())
