"""Only shims may talk to the routing service, through real processes: control holds an admin
token and a shim token; every RoutingService RPC without the shim token (none, a guess, the
admin token...) is UNAUTHENTICATED and changes nothing (no demotion, no event, no pin, no pair
verdict); the shim with the token serves as before; a shim without it refuses to start with a
message; control refuses to start with an admin token and no shim token, or one token for both."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from baton.frames import Deframer, frame
from baton.v1 import admin_pb2, admin_pb2_grpc, fleet_pb2, routing_pb2, routing_pb2_grpc
from clients.procs import Part
from tests.integration.harness import MODEL, metric, start_shim, wait_until, write_config
from tests.integration.tokenfleet import RPC_TIMEOUT, chat, token_fleet

pytestmark = pytest.mark.timeout(120)

ADMIN = "admin-token-0123456789"
SHIM = "shim-token-9876543210"
TOKENS = {"BATON_ADMIN_TOKEN": ADMIN, "BATON_SHIM_TOKEN": SHIM}
Metadata = tuple[tuple[str, str], ...]
AS_SHIM: Metadata = (("authorization", f"Bearer {SHIM}"),)
AS_ADMIN: Metadata = (("authorization", f"Bearer {ADMIN}"),)
# Each way of not holding the shim token; the admin token is one of them.
BAD: dict[str, Metadata] = {
    "none": (),
    "wrong": (("authorization", "Bearer guess"),),
    "admin-token": AS_ADMIN,
    "no-scheme": (("authorization", SHIM),),
    "prefix": (("authorization", f"Bearer {SHIM[:-1]}"),),
}


@dataclass
class Guarded:
    """Control (both tokens) over serve sims t0, t1 and a draft d paired with t0; a shim with
    the shim token; a chat turn through it left pins."""

    control: Part
    shim: Part
    admin: admin_pb2_grpc.AdminServiceStub
    routing: routing_pb2_grpc.RoutingServiceStub
    pair_id: str


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    path: Path = tmp_path_factory.mktemp("shim-auth")
    with token_fleet(path, ADMIN, SHIM) as f:
        admin = admin_pb2_grpc.AdminServiceStub(f.channel)
        routing = routing_pb2_grpc.RoutingServiceStub(f.channel)
        yield Guarded(f.control, f.shim, admin, routing, f.pair_id)


def state(g: Guarded) -> dict[str, Any]:
    """Everything a routing call could change, read over the admin service."""
    kw: dict[str, Any] = {"metadata": AS_ADMIN, "timeout": RPC_TIMEOUT}
    backends = g.admin.ListBackends(admin_pb2.ListBackendsRequest(), **kw)
    pins = g.admin.ListPins(admin_pb2.ListPinsRequest(limit=1000), **kw)
    pairs = g.admin.ListPairs(admin_pb2.ListPairsRequest(), **kw)
    events = g.admin.ListEvents(admin_pb2.ListEventsRequest(limit=100_000), **kw).events
    status = g.admin.GetStatus(admin_pb2.GetStatusRequest(), **kw)
    return {
        "backends": sorted(
            (b.backend.id, b.state, b.reason, b.in_flight) for b in backends.backends
        ),
        "pins": (pins.total, sorted((p.prefix, p.backend_id, p.depth) for p in pins.pins)),
        "pairs": sorted(
            (p.id, p.target_backend_id, p.bound_target_backend_id, p.state, p.rounds, p.reason)
            for p in pairs.pairs
        ),
        "events": [(e.seq, e.kind, e.backend_id) for e in events],
        "in_flight": status.in_flight,
    }


SHAPE = routing_pb2.RequestShape(
    model=MODEL,
    message_count=2,
    prefix_chain=[b"\x01" * 16, b"\x02" * 16],
    assistant_turns=[False, False],
    prompt_chars=500,
    greedy=True,
    stream=True,
)


def _route(request_id: str) -> routing_pb2.RouteRequest:
    return routing_pb2.RouteRequest(request_id=request_id, shape=SHAPE)


def _outcome() -> routing_pb2.RequestOutcome:
    return routing_pb2.RequestOutcome(
        request_id="intruder-1", backend_id="t1", outcome=routing_pb2.OUTCOME_BACKEND_ERROR,
        http_status=500, model=MODEL, message_count=2, reply_chain_hash=b"\x03" * 16,
    )  # fmt: skip


def _failover() -> routing_pb2.FailoverRequest:
    return routing_pb2.FailoverRequest(
        request_id="intruder-2", shape=SHAPE, failed_backend_id="t0", failure="truncated"
    )


Call = Callable[[Guarded, Metadata], object]


def _unary(method: str, request: Callable[[Guarded], object]) -> Call:
    def call(g: Guarded, md: Metadata) -> object:
        return getattr(g.routing, method)(request(g), metadata=md, timeout=RPC_TIMEOUT)

    return call


def _route_stream(g: Guarded, md: Metadata) -> object:
    # A route, a failure outcome and a failover in one message: let through, each would
    # change the fleet (a route event and pins, a pin on t1, t0 demoted).
    msg = routing_pb2.RouteStreamRequest(
        routes=[_route("intruder-3")], outcomes=[_outcome()], failovers=[_failover()]
    )
    return next(iter(g.routing.RouteStream(iter([msg]), metadata=md, timeout=RPC_TIMEOUT)))


def _watch(g: Guarded, md: Metadata) -> object:
    stream = g.routing.WatchSnapshots(
        routing_pb2.WatchSnapshotsRequest(), metadata=md, timeout=RPC_TIMEOUT
    )
    return next(iter(stream))  # let through, the fleet's snapshot comes at once


# Every RoutingService RPC, with a request that would change the fleet (or leak it) if let
# through: test_every_routing_rpc_is_covered keeps this in step with the proto.
CALLS: dict[str, Call] = {
    "Route": _unary("Route", lambda g: _route("intruder-4")),
    "RouteStream": _route_stream,
    "ReportAttemptFailure": _unary(
        "ReportAttemptFailure",
        lambda g: routing_pb2.ReportAttemptFailureRequest(
            request_id="intruder-5", backend_id="t0", failure="connect", detail="forged"
        ),
    ),
    "ReportOutcomes": _unary(
        "ReportOutcomes", lambda g: routing_pb2.ReportOutcomesRequest(outcomes=[_outcome()])
    ),
    "Failover": _unary("Failover", lambda g: _failover()),
    "ReportFailover": _unary(
        "ReportFailover",
        lambda g: routing_pb2.ReportFailoverRequest(
            request_id="intruder-6",
            from_backend_id="t0",
            to_backend_id="t1",
            failure="truncated",
            tokens_sent=3,
            attempt=1,
            outcome=routing_pb2.FAILOVER_OUTCOME_RESUMED,
            detail="forged",
        ),  # fmt: skip
    ),
    "WatchSnapshots": _watch,
    "GatePairing": _unary(
        "GatePairing",
        lambda g: routing_pb2.GatePairingRequest(
            request_id="intruder-7",
            pair_id=g.pair_id,
            target_backend_id="t1",
            drafted=40,
            accepted=0,
        ),  # fmt: skip
    ),
    # A forged owner would send a stored response's follow-ups to the wrong backend.
    "RecordOwnership": _unary(
        "RecordOwnership",
        lambda g: routing_pb2.RecordOwnershipRequest(
            key="resp_forged", backend_id="t1", model="m", request_id="intruder-8"
        ),
    ),
}


def test_every_routing_rpc_is_covered() -> None:
    service = routing_pb2.DESCRIPTOR.services_by_name["RoutingService"]
    assert set(CALLS) == set(service.methods_by_name)


@pytest.mark.parametrize("who", sorted(BAD))
@pytest.mark.parametrize("rpc", list(CALLS))
def test_without_the_shim_token_every_routing_rpc_is_refused_and_changes_nothing(
    guarded: Guarded, rpc: str, who: str
) -> None:
    before = state(guarded)
    assert before["pins"][0] > 0 and before["pairs"]
    assert all(b[1] == fleet_pb2.HEALTH_STATE_HEALTHY for b in before["backends"])
    with pytest.raises(grpc.RpcError) as err:
        CALLS[rpc](guarded, BAD[who])
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, err.value
    assert "shim token" in (err.value.details() or "")
    assert state(guarded) == before


def route_port(g: Guarded) -> int:
    """Control's route socket, as it tells shims with each snapshot."""
    stream = g.routing.WatchSnapshots(
        routing_pb2.WatchSnapshotsRequest(), metadata=AS_SHIM, timeout=RPC_TIMEOUT
    )
    port = next(iter(stream)).route_port
    assert port, "control told no route socket"
    return port


def over_route_socket(g: Guarded, authorization: str, *frames: bytes) -> list[bytes]:
    """A hello with `authorization`, then `frames` at once (not waiting for the welcome), on
    control's route socket; every frame control sent back until it closed the socket or
    went quiet (it answers a frame within RPC_TIMEOUT)."""
    hello = frame(routing_pb2.RouteSocketHello(authorization=authorization))
    got: list[bytes] = []
    deframer = Deframer()
    with socket.create_connection(("127.0.0.1", route_port(g)), timeout=RPC_TIMEOUT) as sock:
        sock.sendall(hello + b"".join(frames))
        try:
            while data := sock.recv(65536):
                got += deframer.feed(data)
        except TimeoutError:
            pass  # open and quiet: all it will answer
        except ConnectionResetError:
            pass  # closed with our frames unread
    return got


def _intrusion() -> bytes:
    return frame(
        routing_pb2.RouteStreamRequest(
            routes=[_route("intruder-9")], outcomes=[_outcome()], failovers=[_failover()]
        )
    )


@pytest.mark.parametrize("who", sorted(BAD))
def test_without_the_shim_token_the_route_socket_refuses_and_changes_nothing(
    guarded: Guarded, who: str
) -> None:
    """The route socket carries RouteStream's messages without gRPC: the same token guards it,
    and a route, a failure outcome and a failover sent right behind a bad hello are never
    read."""
    before = state(guarded)
    got = over_route_socket(guarded, dict(BAD[who]).get("authorization", ""), _intrusion())
    assert len(got) == 1, got  # the refusal, then the socket closed: nothing answered
    welcome = routing_pb2.RouteSocketWelcome.FromString(got[0])
    assert "shim token missing or wrong" in welcome.refused
    assert state(guarded) == before


def test_with_the_shim_token_the_route_socket_answers(guarded: Guarded) -> None:
    ask = routing_pb2.RouteStreamRequest(routes=[_route("shim-socket-1")])
    got = over_route_socket(guarded, f"Bearer {SHIM}", frame(ask))
    assert routing_pb2.RouteSocketWelcome.FromString(got[0]).refused == ""
    answer = routing_pb2.RouteStreamResponse.FromString(got[1])
    assert [r.request_id for r in answer.results] == ["shim-socket-1"]
    assert answer.results[0].response.backends[0].id in ("t0", "t1")


@pytest.mark.parametrize(
    "junk",
    [
        b"\xff\xff\xff\xff",  # a frame of 4 GiB announced
        b"\x00\x00\x00\x05hello",  # not a hello
        b"\x00\x00\x10\x01" + b"x" * 4097,  # a hello longer than a token
    ],
    ids=["huge", "garbage", "long-hello"],
)
def test_junk_on_the_route_socket_is_cut_off_and_control_serves_on(
    guarded: Guarded, junk: bytes
) -> None:
    before = state(guarded)
    with socket.create_connection(("127.0.0.1", route_port(guarded)), timeout=RPC_TIMEOUT) as s:
        s.sendall(junk)
        try:
            assert s.recv(65536) == b"", "control answered junk"
        except ConnectionResetError:
            pass  # cut off: what we want
    assert state(guarded) == before
    # The socket still answers (a refusal: a check that changes nothing, so the next test's
    # "before" is not moved by an outcome landing late).
    again = over_route_socket(guarded, "Bearer guess")
    assert "shim token" in routing_pb2.RouteSocketWelcome.FromString(again[0]).refused


def test_the_shim_token_is_refused_by_the_admin_service(guarded: Guarded) -> None:
    before = state(guarded)
    with pytest.raises(grpc.RpcError) as err:
        guarded.admin.DrainBackend(
            admin_pb2.DrainBackendRequest(id="t0"), metadata=AS_SHIM, timeout=RPC_TIMEOUT
        )
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert state(guarded) == before


def test_with_the_shim_token_routing_calls_work(guarded: Guarded) -> None:
    """The same service lets the shim token through (so the refusals above are about the
    token): a forged-looking failover report is recorded, a route is answered, snapshots come;
    and the shim with the token serves streamed and plain chats."""
    kw: dict[str, Any] = {"metadata": AS_SHIM, "timeout": RPC_TIMEOUT}
    snapshot = next(iter(guarded.routing.WatchSnapshots(routing_pb2.WatchSnapshotsRequest(), **kw)))
    assert {b.backend.id for b in snapshot.snapshot.backends} >= {"t0", "t1"}
    routed = guarded.routing.Route(_route("shim-1"), **kw)
    assert routed.backends[0].id in ("t0", "t1")
    before = len(state(guarded)["events"])
    CALLS["ReportFailover"](guarded, AS_SHIM)
    assert wait_until(lambda: len(state(guarded)["events"]) > before)
    for stream in (True, False):
        status, raw = chat(guarded.shim.ready, "and again", stream=stream)
        assert status == 200, raw
    # The shim's routes ride control's route socket, behind the same token.
    assert metric(guarded.shim.ready, "baton_shim_route_socket") == 1


def run_module(module: str, *argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A part run to its end (it is expected to refuse to start)."""
    return subprocess.run(
        [sys.executable, "-m", module, *argv], env={**os.environ, **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("token", ["", "guess", ADMIN])
def test_a_shim_without_the_token_says_so_and_exits(guarded: Guarded, token: str) -> None:
    out = run_module(
        "dataplane", "--control", guarded.control.ready, "--listen", "127.0.0.1:0",
        env={"BATON_SHIM_TOKEN": token},
    )  # fmt: skip
    assert out.returncode != 0 and "SHIM READY" not in out.stdout, out
    assert "control refused this shim" in out.stderr, out.stderr
    assert "shim token missing or wrong" in out.stderr and "Traceback" not in out.stderr


def test_a_shim_reads_the_token_from_a_file(guarded: Guarded, tmp_path: Path) -> None:
    token_file = tmp_path / "shim-token"
    token_file.write_text(SHIM + "\n")
    shim = start_shim(
        guarded.control.ready, "--shim-token-file", str(token_file), env={"BATON_SHIM_TOKEN": ""}
    )
    try:
        status, raw = chat(shim.ready)
        assert status == 200 and b"[DONE]" in raw, raw
    finally:
        shim.stop(grace=3)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"BATON_ADMIN_TOKEN": ADMIN, "BATON_SHIM_TOKEN": ""}, "no shim token is"),
        ({"BATON_ADMIN_TOKEN": ADMIN, "BATON_SHIM_TOKEN": ADMIN}, "are the same"),
    ],
)
def test_control_will_not_start_half_guarded(
    tmp_path: Path, env: dict[str, str], says: str
) -> None:
    config = write_config(tmp_path / "control.toml", [], probe_interval=0.2)
    out = run_module(
        "control", "--config", str(config), "--listen", "127.0.0.1:0", "--metrics-listen", "",
        env=env,
    )  # fmt: skip
    assert out.returncode == 2, out
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
