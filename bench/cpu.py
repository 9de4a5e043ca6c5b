"""CPU accounting and pinning of benchmark processes through /proc (Linux only)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[bytes]:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    # The command name may contain spaces or ')': fields are counted after the last ')'.
    return data[data.rfind(b")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all its threads), in seconds; 1/CLK_TCK resolution."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / _TICK


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            kids += [int(c) for c in (task / "children").read_text().split()]
    return kids


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and of every process under it, live or exited and reaped
    (cutime + cstime): a part that forks helpers or workers is accounted whole."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += sum(int(f) for f in _stat_fields(p)[11:15]) / _TICK
            todo += _children(p)
        except FileNotFoundError:
            continue  # ended between the listing and the read
    return total


def pin(pid: int, cores: set[int]) -> None:
    """Pin every thread of `pid`: sched_setaffinity on a pid moves only its main thread, and
    the parts start worker threads (gRPC, executors) before they print READY."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


@contextlib.contextmanager
def children_pinned(cores: set[int] | None) -> Iterator[None]:
    """Processes started inside run on `cores` from their first instruction (affinity is
    inherited across fork and exec), so pools sized from the cores a process sees, such as
    tokio's worker threads in the Rust routers, are sized to these. None: no pinning."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True, slots=True)
class Cores:
    """Where each side runs: the engine and load generator share one core, Baton (or the
    router under test) gets another, so its CPU cost shows up as its own core's load and not
    as the engine's slowdown."""

    engine: set[int]
    baton: set[int]


def plan_cores(pin_enabled: bool) -> Cores | None:
    """The first two usable cores, whatever the machine has, so a run means the same on any
    machine; None when pinning is off or there are fewer than two."""
    usable = sorted(os.sched_getaffinity(0))
    if not pin_enabled or len(usable) < 2:
        return None
    return Cores(engine={usable[0]}, baton={usable[1]})
