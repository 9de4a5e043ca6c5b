"""Which waiting requests one engine rank runs: vLLM 0.32's scheduler, as far as the sim
models it (pure: the waiters are whatever the caller wakes; sim.engine's are futures).

* At most ``slots`` requests run at once (--max-num-seqs); the rest wait in arrival order.
* With LoRA on, at most ``max_loras`` distinct adapters are in the running batch. A
  waiting request whose adapter would be one too many is skipped, not blocking those behind
  it (v1/core/sched/scheduler.py: "Scheduling would exceed max_loras, skip."), and runs
  once one of the running adapters has no request left. Base-model requests never wait
  for that.

Whenever a request ends, the waiting ones are scanned in order and each that may run now
runs; so a newcomer that may run at once never passes one that could have run.
"""

# baton: pure

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

W = TypeVar("W")


class Admission(Generic[W]):
    """``lora`` is an adapter's int id, None for the base model."""

    __slots__ = ("_free", "_max_loras", "_running", "_waiters")

    def __init__(self, slots: int, max_loras: int | None = None) -> None:
        self._free = max(1, slots)
        self._max_loras = max_loras
        self._running: dict[int, int] = {}  # adapter int id -> its running requests
        self._waiters: deque[tuple[int | None, W]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def running_adapters(self) -> set[int]:
        return set(self._running)

    def try_take(self, lora: int | None) -> bool:
        """Run at once if it may; else the caller waits (``wait``)."""
        if self._free > 0 and self._fits(lora):
            self._take(lora)
            return True
        return False

    def wait(self, lora: int | None, waiter: W) -> None:
        self._waiters.append((lora, waiter))

    def cancel(self, waiter: W) -> bool:
        """Take a waiter out of the queue; False when it was not there (it was admitted:
        its place is taken and the caller gives it back)."""
        for i, (_, w) in enumerate(self._waiters):
            if w is waiter:
                del self._waiters[i]
                return True
        return False

    def give(self, lora: int | None) -> list[W]:
        """A running request ended; the waiters that run now (their places taken)."""
        self._free += 1
        if lora is not None:
            left = self._running[lora] - 1
            if left:
                self._running[lora] = left
            else:
                del self._running[lora]
        return self._wake() if self._waiters else []

    def _fits(self, lora: int | None) -> bool:
        if lora is None or self._max_loras is None or lora in self._running:
            return True
        return len(self._running) < self._max_loras

    def _take(self, lora: int | None) -> None:
        self._free -= 1
        if lora is not None:
            self._running[lora] = self._running.get(lora, 0) + 1

    def _wake(self) -> list[W]:
        woken: list[W] = []
        waiters = self._waiters
        while waiters and self._free > 0 and self._fits(waiters[0][0]):  # all, without LoRA
            lora, waiter = waiters.popleft()
            self._take(lora)
            woken.append(waiter)
        if not waiters or self._free <= 0:
            return woken
        kept: deque[tuple[int | None, W]] = deque()  # the head waits for an adapter: skip it
        for lora, waiter in waiters:
            if self._free > 0 and self._fits(lora):
                self._take(lora)
                woken.append(waiter)
            else:
                kept.append((lora, waiter))
        self._waiters = kept
        return woken
