"""CPU accounting and pinning of benchmark processes through /proc (Linux only)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all its threads), in seconds; 1/CLK_TCK resolution."""
    data = Path(f"/proc/{pid}/stat").read_bytes()
    # The command name may contain spaces or ')': fields are counted after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def pin(pid: int, cores: set[int]) -> None:
    """Pin every thread of `pid`: sched_setaffinity on a pid moves only its main thread, and
    the parts start worker threads (gRPC, executors) before they print READY."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


@dataclass(frozen=True, slots=True)
class Cores:
    """Where each side runs: the engine and load generator share one core, Baton gets another,
    so Baton's CPU cost shows up as its own core's load and not as the engine's slowdown."""

    engine: set[int]
    baton: set[int]


def plan_cores(pin_enabled: bool) -> Cores | None:
    """None when pinning is off or there are fewer than two usable cores."""
    usable = sorted(os.sched_getaffinity(0))
    if not pin_enabled or len(usable) < 2:
        return None
    return Cores(engine={usable[0]}, baton={usable[1]})
