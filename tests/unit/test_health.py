"""The probes' answers (dataplane/edge/health.py) and how the front door tells a probe from traffic
by a connection's first bytes (frontdoor.classify), which it reads without taking them."""

from __future__ import annotations

import pytest

from dataplane.edge.frontdoor import MAX_HEAD, Head, classify, response
from dataplane.edge.health import STALLED_S, Health, View, answer

NOW = 1000.0


def view(**kw: object) -> View:
    base: dict[str, object] = {"heartbeat": NOW, "in_flight": 3, "cap": 8, "draining": False,
                               "routable": True}  # fmt: skip
    return View(**{**base, **kw})  # type: ignore[arg-type]


def test_liveness_holds_through_load_and_drain_but_not_a_wedged_loop() -> None:
    for v in (view(), view(in_flight=8), view(draining=True), view(routable=False)):
        assert answer("/health/live", v, NOW) == answer("/health", v, NOW)
        assert answer("/health/live", v, NOW).status == 200
    wedged = answer("/health/live", view(heartbeat=NOW - STALLED_S - 1), NOW)
    assert wedged.status == 503 and b"has not turned" in wedged.body


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({"in_flight": 8}, b"at its in-flight cap (8)"),
        ({"draining": True}, b"draining"),
        ({"routable": False}, b"no snapshot"),
    ],
)
def test_readiness_says_why_no_new_work_should_come(state: dict[str, object], why: bytes) -> None:
    assert answer("/health/ready", view(), NOW).status == 200
    got = answer("/health/ready", view(**state), NOW)
    assert got.status == 503 and why in got.body


def test_the_state_block_round_trips_and_the_shims_side_reads_its_values() -> None:
    v = view(in_flight=5, draining=True)
    assert View.unpack(v.pack()) == v
    slots = [2]
    h = Health(lambda: slots[0], 2, lambda: True, lambda: NOW)
    assert h.answer("/health/ready").status == 503
    slots[0] = 1
    assert h.answer("/health/ready").status == 200
    h.draining = True
    assert h.view().draining and h.answer("/health/live").status == 200


def test_the_front_door_answers_whole_probe_heads_and_passes_everything_else() -> None:
    head = b"GET /health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    assert classify(head) == (Head.HEALTH, len(head), "/health/ready", False)
    assert classify(b"HEAD /health HTTP/1.1\r\n\r\n")[::2] == (Head.HEALTH, "/health")
    assert classify(b"GET /health/live?x=1 HTTP/1.1\r\n\r\n")[2] == "/health/live"
    # Still arriving: wait for more (bounded by the front door's WAIT_S and MAX_HEAD).
    for partial in (b"G", b"GET /hea", b"GET /health/ready HTTP/1.1\r\nHost"):
        assert classify(partial)[0] is Head.WAIT, partial
    # Traffic, the other paths, and heads past the limit go to the shim untouched.
    for other in (b"POST /v1/chat/completions HTTP/1.1\r\n", b"GET /v1/models HTTP/1.1\r\n",
                  b"GET /healthz HTTP/1.1\r\n\r\n", b"GET /metrics ", b"PUT /health",
                  b"GET /health/ready HTTP/1.1\r\n" + b"X: y\r\n" * MAX_HEAD):  # fmt: skip
        assert classify(other)[0] is Head.OTHER, other[:40]
    reply = response(503, b"not ready: draining", head_only=False)
    assert reply.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"Connection: close\r\n" in reply and reply.endswith(b"\r\n\r\nnot ready: draining")
    assert response(200, b"ok", head_only=True).endswith(b"\r\n\r\n")
