"""`python -m bench.profile`: where Baton's CPU goes per request, stage by stage, next to the
aiohttp floor's (issue 28's "where the time goes").

Three lean engines (bench/lean_engine.py), then Baton (control + shim) and the floor
(bench/floor_proxy.py), each router process run under py-spy (sampling, `--nonblocking`, so
the process is never paused). A closed-loop load at `--concurrency` (64) runs against Baton,
then against the floor; each process's CPU per request is measured by bench.loadgen and split
across stages in the proportions of its samples (bench/profile_stages.py says how a sample is
attributed). py-spy comes from PyPI into the bench's own virtualenv (bench/peers.py), never
into Baton's. It starts the processes itself (`py-spy record -- python -m ...`): attaching to
a running one needs ptrace rights that containers often lack.

Sampling costs the sampled process a little: compare the stages' shares, and take the CPU per
request from bench.overhead, which runs without a profiler.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench import peers, profile_stages
from bench.overhead import await_serving, run_loadgen
from bench.parts import MODEL, control_argv, control_toml, shim_argv
from clients.procs import Part

PYSPY = peers.Peer("pyspy", "py-spy", "0.4.3", "")  # a binary: nothing to import
RESULTS = Path(__file__).parent / "results"


def pyspy(logdir: Path) -> Path:
    """py-spy's binary in the bench's virtualenv, installed the first time."""
    return peers.installed(PYSPY, peers.peers_venv(), logdir).parent / "py-spy"


@dataclass
class Sampled:
    """A part started under py-spy: `pid` is the Python process (py-spy is its parent)."""

    name: str
    spy: subprocess.Popen[str]
    ready: str
    pid: int
    samples: Path

    def stop(self) -> None:
        """SIGTERM to the Python process: it stops as it would, and py-spy then writes."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.spy.wait(30)
        except subprocess.TimeoutExpired:
            self.spy.kill()


def sampled(name: str, argv: list[str], outdir: Path, rate: int) -> Sampled:
    samples = outdir / f"profile.{name}.txt"
    spy = subprocess.Popen(
        [str(pyspy(outdir)), "record", "--nonblocking", "-r", str(rate), "-f", "raw",
         "-o", str(samples), "--", sys.executable, "-m", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    assert spy.stdout is not None  # noqa: S101 - asked for a pipe
    line = ""
    while " READY " not in line:
        line = spy.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} did not start under py-spy")
    # Keep draining its stdout, so a chatty part never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in spy.stdout or ()], daemon=True).start()
    child = subprocess.run(["pgrep", "-P", str(spy.pid)], capture_output=True, text=True)
    return Sampled(name, spy, line.strip().rsplit(" ", 1)[1], int(child.stdout.split()[0]),
                   samples)  # fmt: skip


@contextlib.contextmanager
def running(outdir: Path, rate: int) -> Iterator[tuple[Sampled, Sampled, Sampled]]:
    """(control, shim, floor), each under py-spy, in front of three lean engines."""
    with contextlib.ExitStack() as stack:
        engines = [Part(f"e{i}", ["bench.lean_engine", "--model", MODEL]) for i in range(3)]
        for e in engines:
            stack.callback(e.stop, 3.0)
        config = outdir / "profile.control.toml"
        config.write_text(control_toml({f"e{i}": e.ready for i, e in enumerate(engines)}))
        control = sampled("control", control_argv(str(config)), outdir, rate)
        stack.callback(control.stop)
        shim = sampled("shim", shim_argv(control.ready), outdir, rate)
        stack.callback(shim.stop)  # callbacks run last first: the shim stops before control
        floor = sampled("floor", ["bench.floor_proxy",
                                  *(a for e in engines for a in ("--upstream", e.ready))],
                        outdir, rate)  # fmt: skip
        stack.callback(floor.stop)
        await_serving(shim.ready)
        yield control, shim, floor


def load(
    url: str, concurrency: int, duration: float, parts: dict[str, int], stream: bool = False
) -> dict[str, float]:
    """CPU µs per request of each of `parts` under a closed-loop load: non-streamed, or
    `stream`ed (64-token streams, as bench.overhead's)."""
    shape = ["--stream", "--max-tokens", "64"] if stream else ["--max-tokens", "8"]
    argv = [sys.executable, "-m", "bench.loadgen", "--url", url, "--concurrency",
            str(concurrency), "--duration", str(duration), "--warmup", "1", "--model", MODEL,
            *shape, *(a for n, p in parts.items() for a in ("--pid", f"{n}={p}"))]
    raw = run_loadgen(argv, duration + 90, f"profile c={concurrency}")  # fmt: skip
    served = max(1, int(raw["ok_in_window"]))
    return {n: raw["cpu_s"][n] * 1e6 / served for n in parts}


def table(rows: dict[str, dict[str, float]]) -> str:
    """Stages down, processes across, µs per request."""
    names = list(rows)
    stages = sorted({s for r in rows.values() for s in r},
                    key=lambda s: -max(r.get(s, 0.0) for r in rows.values()))  # fmt: skip
    width = max(len(s) for s in stages) + 2
    out = ["stage".ljust(width) + "".join(f"{n:>10}" for n in names)]
    for s in stages:
        out.append(s.ljust(width) + "".join(f"{rows[n].get(s, 0.0):>10.0f}" for n in names))
    out.append("total".ljust(width) + "".join(f"{sum(rows[n].values()):>10.0f}" for n in names))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=15.0, help="seconds of load per router")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--stream", action="store_true", help="64-token streams, not plain requests")
    p.add_argument("--json", type=Path, default=RESULTS / "profile.json")
    a = p.parse_args(argv)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    with running(a.json.parent, a.rate) as (control, shim, floor):
        baton_cpu = load(shim.ready, a.concurrency, a.duration,
                         {"shim": shim.pid, "control": control.pid}, a.stream)  # fmt: skip
        floor_cpu = load(floor.ready, a.concurrency, a.duration, {"floor": floor.pid}, a.stream)
    rows = {}
    for part, stages, cpu in ((shim, profile_stages.SHIM, baton_cpu["shim"]),
                              (control, profile_stages.CONTROL, baton_cpu["control"]),
                              (floor, profile_stages.SHIM, floor_cpu["floor"])):  # fmt: skip
        with part.samples.open() as f:
            rows[part.name] = profile_stages.per_request(profile_stages.attribute(f, stages), cpu)
    kind = "64-token streams" if a.stream else "non-streamed"
    print(f"CPU µs per request by stage, {kind}, c={a.concurrency} (under py-spy):")
    print(table(rows))
    a.json.write_text(json.dumps({"concurrency": a.concurrency, "stream": a.stream,
                                  "cpu_us": {**baton_cpu,
                                  **floor_cpu}, "stages": rows}, indent=1))  # fmt: skip
    print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
