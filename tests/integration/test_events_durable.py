"""docs/operations.md's promise about the audit log, through real processes: failovers, retries,
health and admin events reach --data-dir at once, so a control SIGKILLed right after `baton events`
showed them still lists every one of them after a restart with the same data dir.

Control also flushes the file every 0.2 s, which would hide a missing immediate write if the
kill came later than that. So before the kill the test asks over the same ListEvents RPC as
`baton events`, in-process (AdminClient: no CLI start-up of a few hundred ms), and the drain's
admin event is recorded a few ms before the SIGKILL, inside one periodic-flush window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clients.client import AdminClient
from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    http_full,
    start_control,
    start_shim,
    start_sim,
    wait_until,
    write_config,
)
from tests.integration.harness import cli_json as baton

pytestmark = pytest.mark.timeout(120)

DURABLE_KINDS = ("failover", "retry", "health", "admin")


def durable_events(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every audit event but routing decisions (those ride a periodic flush by design)."""
    return [e for e in rows if e["kind"] != "route"]


def stream_one(shim: Part) -> str:
    """One streamed chat completion through the shim; returns its request id."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "the quick brown fox"}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    status, data, headers = http_full(
        "POST", shim.ready + "/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 200, data
    # The client saw one whole stream: the failover and the retry are invisible to it.
    assert data.rstrip().endswith(b"data: [DONE]"), data[-200:]
    return headers["X-Request-Id"]


def test_failover_retry_health_and_admin_events_survive_a_sigkilled_control(
    tmp_path: Path,
) -> None:
    crash = start_sim("--fault", "exit-after=5")  # dies mid-stream: a failover
    refuse = start_sim("--fault", "status=503")  # probes pass, requests refused: retries
    ok = start_sim()
    parts: list[Part] = [crash, refuse, ok]
    config = write_config(
        tmp_path / "control.toml",
        [("crash", crash.ready), ("refuse", refuse.ready), ("ok", ok.ready)],
    )
    data = ("--data-dir", str(tmp_path / "data"))
    try:
        control = start_control(config, *data)
        parts.append(control)
        shim = start_shim(control.ready)
        parts.append(shim)

        admin = AdminClient(control.ready)

        def listed() -> list[dict[str, Any]]:
            return durable_events(admin.events(limit=100_000))

        # Bounded: requests until control has heard of both a failover (the crash sim died
        # mid-stream) and a retry (the refusing sim answered 503 before the first byte).
        rids: list[str] = []
        seen: list[dict[str, Any]] = []

        def have_both() -> bool:
            if not {"failover", "retry"} <= {e["kind"] for e in seen}:
                rids.append(stream_one(shim))
            seen[:] = listed()
            return {"failover", "retry"} <= {e["kind"] for e in seen}

        assert wait_until(have_both, 30, interval=0), seen
        assert wait_until(lambda: not crash.alive, 10)

        want: list[dict[str, Any]] = []

        def acknowledged() -> bool:
            want[:] = listed()
            kinds = {e["kind"] for e in want}
            drain = any(
                e["kind"] == "admin" and e["backend_id"] == "refuse" and e["action"] == "drain"
                for e in want
            )
            return set(DURABLE_KINDS) <= kinds and drain

        assert admin.drain_backend("refuse").state == "draining"
        assert wait_until(acknowledged, 10, interval=0), want
        control.kill()  # the whole process group, SIGKILL, no grace: nothing else runs
        admin.close()
        assert control.proc.returncode == -9

        # What the test saw is what it claims: a failover and a retry of its own requests.
        failovers = [e for e in want if e["kind"] == "failover"]
        retries = [e for e in want if e["kind"] == "retry"]
        assert any(e["request_id"] in rids and e["backend_id"] == "crash" for e in failovers), (
            failovers, rids,
        )  # fmt: skip
        assert any(e["request_id"] in rids and e["backend_id"] == "refuse" for e in retries), (
            retries, rids,
        )  # fmt: skip
        assert any(e["kind"] == "health" for e in want)

        control = start_control(config, *data)
        parts.append(control)
        after = durable_events(baton(control, "events", "--limit", "100000"))
        by_seq = {e["seq"]: e for e in after}
        missing = [e for e in want if by_seq.get(e["seq"]) != e]
        assert not missing, {"missing": missing, "after": after}
        for kind in DURABLE_KINDS:
            # Each kind also answers its own filter after the restart.
            of_kind = baton(control, "events", "--kind", kind, "--limit", "100000")
            assert [e for e in want if e["kind"] == kind] == [
                e for e in of_kind if e["seq"] <= want[-1]["seq"]
            ], kind
        for e in failovers + retries:
            found = baton(control, "events", "--request-id", e["request_id"])
            assert e in found, (e, found)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)
