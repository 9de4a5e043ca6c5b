"""Control-plane outage (docs/architecture.md#when-control-is-unreachable): control is SIGKILLed in
the middle of a streaming load; the shim keeps serving from its last snapshot (failovers included),
buffers its reports, and delivers them to a new control process on the same address."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clients.procs import Part
from tests.integration.harness import (
    Fleet,
    Streamed,
    metric,
    start_control,
    start_shim,
    start_sim,
    stream,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.timeout(90)

SHORT, LONG = 8, 24  # s0 dies after 10 tokens: short streams never see it, long ones do
REQUESTS, CONCURRENCY, KILL_AFTER = 40, 4, 8
PACE = ("--decode-ms-per-step", "4")  # ~0.1 s a long stream: the kill lands mid-stream


@pytest.fixture
def outage_fleet(tmp_path: Path) -> Iterator[Fleet]:
    parts: list[Part] = []
    try:
        sims = {"s0": start_sim(*PACE, "--fault", "die-after=10"), "s1": start_sim(*PACE)}
        parts += sims.values()
        config = write_config(tmp_path / "control.toml", [(k, p.ready) for k, p in sims.items()])
        control = start_control(config)
        parts.append(control)
        shim = start_shim(control.ready)
        parts.append(shim)
        yield Fleet(sims, control, shim, parts)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def failover_events(f: Fleet) -> list[dict[str, object]]:
    out = f.baton("events", "--kind", "failover", "--json")
    assert out.returncode == 0, out.stderr
    events: list[dict[str, object]] = json.loads(out.stdout)
    return events


def test_control_killed_mid_load_then_restarted(outage_fleet: Fleet, tmp_path: Path) -> None:
    f = outage_fleet
    shim = f.shim.ready
    # What an uninterrupted stream says, from the healthy replica directly.
    want = {n: stream(f.sims["s1"].ready, n).text for n in (SHORT, LONG)}
    assert all(want.values())

    killed = threading.Event()
    completed = 0
    lock = threading.Lock()

    def one(_: int) -> Streamed:
        nonlocal completed
        # Long streams (which fail over on s0) only once control is gone: the failovers
        # this test counts all happen during the outage.
        result = stream(shim, LONG if killed.is_set() else SHORT)
        with lock:
            completed += 1
            if completed == KILL_AFTER:
                f.control.kill()  # SIGKILL, with up to 3 other streams in flight
                killed.set()
        return result

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(one, range(REQUESTS)))

    assert killed.is_set() and not f.control.alive
    bad = [r for r in results if r.status != 200 or r.error or not r.done]
    assert bad == [], bad  # 0 client errors, every stream ended with [DONE]
    for r in results:  # complete and byte-identical, failovers included
        assert (r.text, r.finish) == (want[r.max_tokens], "length")
    assert sum(r.max_tokens == LONG for r in results) >= REQUESTS - KILL_AFTER - 2 * CONCURRENCY

    assert metric(shim, "baton_shim_degraded") == 1
    assert metric(shim, "baton_shim_degraded_routes_total") >= REQUESTS - KILL_AFTER
    # A failover is counted once its seam check (after the resumed stream's end) is done.
    assert wait_until(lambda: metric(shim, "baton_shim_seam_checks_pending") == 0, 10)
    reported = metric(shim, "baton_shim_failovers_total")
    assert reported >= 5  # about half the long streams started on s0 and died there
    assert metric(shim, "baton_shim_buffered_reports") == reported
    assert metric(shim, "baton_shim_buffered_outcomes") >= REQUESTS - KILL_AFTER
    assert metric(shim, "baton_shim_dropped_reports_total") == 0

    # A new control process on the address the first one was given.
    port = f.control.ready.rsplit(":", 1)[1]
    f.control = start_control(tmp_path / "control.toml", "--listen", f"127.0.0.1:{port}")
    f.parts.append(f.control)
    assert f.control.ready == f"127.0.0.1:{port}"

    events: list[dict[str, object]] = []

    def delivered() -> bool:
        events[:] = failover_events(f)
        return len(events) >= reported

    assert wait_until(delivered, 10, 0.2), (len(events), reported)
    keys = {(e["request_id"], e["attempt"], e["choice"]) for e in events}
    assert len(keys) == reported  # every buffered report, none twice (control was down)
    assert {(e["from_backend"], e["to_backend"], e["outcome"]) for e in events} == {
        ("s0", "s1", "resumed")
    }
    assert wait_until(lambda: metric(shim, "baton_shim_degraded") == 0, 5)
    assert metric(shim, "baton_shim_buffered_reports") == 0
    assert wait_until(lambda: metric(shim, "baton_shim_buffered_outcomes") == 0, 5)
    # And the shim routes through the new control again.
    after = stream(shim, SHORT)
    assert (after.status, after.error, after.text) == (200, None, want[SHORT])
    routes = metric(shim, "baton_shim_degraded_routes_total")
    stream(shim, SHORT)
    assert metric(shim, "baton_shim_degraded_routes_total") == routes

    # Over the new control's route socket (another port: the shim learns it from the new
    # process's snapshots), not left on gRPC, once a route has gone since.
    def on_new_socket() -> bool:
        stream(shim, SHORT)
        return metric(shim, "baton_shim_route_socket") == 1

    assert wait_until(on_new_socket, 20, 0.2)


ROUTE_TIMEOUT = 3.0


def test_hung_control_costs_one_route_timeout_then_nothing(outage_fleet: Fleet) -> None:
    """A control that hangs (SIGSTOP) refuses nothing: the first request waits out the route
    timeout, later ones are routed by the shim at once, and control is trusted again once
    it answers."""
    f = outage_fleet
    # A route timeout of 3 s (not the default 0.5 s) leaves room between "routed at once"
    # (a SHORT stream takes ~0.05 s idle) and "waited for control" (>= the route timeout).
    own = start_shim(f.control.ready, "--route-timeout", str(ROUTE_TIMEOUT))
    f.parts.append(own)
    shim = own.ready
    assert stream(shim, SHORT).error is None
    f.control.proc.send_signal(signal.SIGSTOP)
    try:
        took = []
        for _ in range(6):
            started = time.monotonic()
            r = stream(shim, SHORT)
            took.append(time.monotonic() - started)
            assert (r.status, r.error, r.done) == (200, None, True)
        # The first waits out the route timeout and is then routed by the shim, not held
        # longer: 5 s over it is 100x what routing and streaming take idle (~0.05 s).
        assert took[0] < ROUTE_TIMEOUT + 5, took
        # No request after the first waits for control: one that did would take at least
        # the route timeout; half of it is >20x what a SHORT stream takes idle.
        assert max(took[1:]) < ROUTE_TIMEOUT / 2, took
        assert metric(shim, "baton_shim_degraded") == 1
    finally:
        f.control.proc.send_signal(signal.SIGCONT)
    assert wait_until(lambda: metric(shim, "baton_shim_degraded") == 0, 5)
    assert metric(shim, "baton_shim_control_outages_total") == 1
