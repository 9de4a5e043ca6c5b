"""Control replicas as a shim and the CLI see them (`--control A,B`): one address leads, the
others refuse. A replica here is `Replica`, an in-process gRPC server that keeps the contract
of control replicas: while it does not lead it refuses every RoutingService and AdminService
call but GetStatus with FAILED_PRECONDITION, naming the leader in trailing metadata
`baton-leader`, and its health says NOT_SERVING for both services; while it leads it passes
every call on to a real control process, counting the outcomes and failover reports that go
through it, and hides that control's route socket (so the shim's RouteStream goes through it
too). When it stops leading it ends its open streams with the same refusal.

The shim finds the leader behind a refusing replica; follows the lead to another address
after its control is SIGKILLed (what was buffered in the gap arrives there, once), and back
when that replica stops leading; with 0 client errors throughout. The CLI goes to the leader
a refusal names, or on to the next address when one is down, and applies a change once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.replicas import LEADER_METADATA
from baton.v1 import admin_pb2, routing_pb2
from clients.procs import Part, free_port
from tests.integration.harness import (
    Streamed,
    control_metric,
    metric,
    start_control,
    start_shim,
    start_sim,
    stream,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.timeout(120)

ROUTING = routing_pb2.DESCRIPTOR.services_by_name["RoutingService"]
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]
# "/package.Service/Method" -> (client streaming, server streaming)
SHAPES = {
    f"/{svc.full_name}/{m.name}": (m.client_streaming, m.server_streaming)
    for svc in (ROUTING, ADMIN)
    for m in svc.methods
}
GET_STATUS = f"/{ADMIN.full_name}/GetStatus"
WATCH = f"/{ROUTING.full_name}/WatchSnapshots"
ROUTE_STREAM = f"/{ROUTING.full_name}/RouteStream"
REPORT_FAILOVER = f"/{ROUTING.full_name}/ReportFailover"


class Replica(grpc.GenericRpcHandler):
    """A control replica (see the module docstring). `follow(id, address)`: another leads;
    `lead(control)`: this one does, passing calls on to the control process at `control`."""

    def __init__(self, replica_id: str) -> None:
        self.id = replica_id
        self.leader = ("", "")  # (id, address) of the leader it names while it follows
        self._upstream: grpc.Channel | None = None
        self._lock = threading.Lock()
        self._open: set[grpc.Future] = set()  # calls passed on, ended when it stops leading
        self.refused: Counter[str] = Counter()  # method -> calls refused
        self.outcomes: Counter[tuple[str, str, int]] = Counter()  # passed on, by content
        self.routes = 0
        self.failover_reports = 0
        self._health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(32))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self._serving(False)
        self.server.start()

    def _serving(self, leads: bool) -> None:
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if leads
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for svc in (ROUTING, ADMIN):
            self._health.set(svc.full_name, status)

    def lead(self, control: str) -> None:
        with self._lock:
            self._upstream = grpc.insecure_channel(control)
        self._serving(True)

    def follow(self, leader_id: str, address: str) -> None:
        """Another leads: health first (as a replica losing its lease), then every call
        passed on is ended, each with the refusal."""
        self._serving(False)
        with self._lock:
            self.leader = (leader_id, address)
            upstream, self._upstream = self._upstream, None
            calls, self._open = self._open, set()
        for call in calls:
            call.cancel()
        if upstream is not None:
            upstream.close()

    def stop(self) -> None:
        self.follow(*self.leader)
        self.server.stop(None)

    # -- grpc.GenericRpcHandler ------------------------------------------------------------

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method  # type: ignore[attr-defined]
        shape = SHAPES.get(method)
        if shape is None:
            return None
        if shape == (False, False):
            return grpc.unary_unary_rpc_method_handler(lambda r, c: self._unary(method, r, c))
        if shape == (False, True):
            return grpc.unary_stream_rpc_method_handler(lambda r, c: self._stream(method, r, c))
        return grpc.stream_stream_rpc_method_handler(lambda r, c: self._stream(method, r, c))

    def _refuse(self, method: str, context: grpc.ServicerContext) -> None:
        leader_id, address = self.leader
        with self._lock:
            self.refused[method] += 1
        if address:
            context.set_trailing_metadata(((LEADER_METADATA, address),))
        where = f"the leader is {leader_id} at {address}" if address else "no leader elected yet"
        context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"control replica {self.id} is not the leader: {where}",
        )

    def _passed_on(self, method: str, context: grpc.ServicerContext) -> grpc.Channel:
        with self._lock:
            upstream = self._upstream
        if upstream is None:
            self._refuse(method, context)
            raise AssertionError("abort raises")  # pragma: no cover
        return upstream

    def _metadata(self, context: grpc.ServicerContext) -> list[tuple[str, str]]:
        """What is passed on of a call's metadata: its token."""
        md = context.invocation_metadata()
        return [(m.key, m.value) for m in md if m.key == "authorization"]

    def _unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        if method == GET_STATUS and self._upstream is None:  # every replica answers it
            return self._status().SerializeToString()
        upstream = self._passed_on(method, context)
        if method == REPORT_FAILOVER:
            with self._lock:
                self.failover_reports += 1
        try:
            answer: bytes = upstream.unary_unary(method)(
                request, metadata=self._metadata(context), timeout=10
            )
        except grpc.RpcError as exc:
            context.abort(exc.code(), exc.details() or "")  # type: ignore[attr-defined]
        if method == GET_STATUS:
            status = admin_pb2.GetStatusResponse.FromString(answer)
            status.MergeFrom(self._status())
            answer = status.SerializeToString()
        return answer

    def _status(self) -> admin_pb2.GetStatusResponse:
        leads = self._upstream is not None
        leader_id, address = (self.id, self.address) if leads else self.leader
        replicas = [admin_pb2.Replica(id=self.id, address=self.address, leader=leads)]
        if not leads and address:
            replicas.insert(0, admin_pb2.Replica(id=leader_id, address=address, leader=True))
        return admin_pb2.GetStatusResponse(
            version="replica", replicas=replicas, leader=leader_id,
            store="etcd://127.0.0.1:2379: ok", replica_id=self.id,
        )  # fmt: skip

    def _counted(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        for raw in requests:
            msg = routing_pb2.RouteStreamRequest.FromString(raw)
            with self._lock:
                self.routes += len(msg.routes)
                self.outcomes.update(
                    (o.request_id, o.backend_id, o.http_status) for o in msg.outcomes
                )
            yield raw

    def _stream(self, method: str, request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
        upstream = self._passed_on(method, context)
        md = self._metadata(context)
        if method == ROUTE_STREAM:
            call = upstream.stream_stream(method)(self._counted(request), metadata=md)
        else:
            call = upstream.unary_stream(method)(request, metadata=md)
        with self._lock:
            if self._upstream is not upstream:  # stopped leading meanwhile
                call.cancel()
            self._open.add(call)
        context.add_callback(call.cancel)
        try:
            for raw in call:
                if method == WATCH:  # its route socket hidden: RouteStream comes through here
                    msg = routing_pb2.WatchSnapshotsResponse.FromString(raw)
                    msg.route_port = 0
                    raw = msg.SerializeToString()
                yield raw
        except grpc.RpcError as exc:
            with self._lock:
                ended = self._upstream is not upstream
                self._open.discard(call)
            if ended:
                self._refuse(method, context)
            context.abort(exc.code(), exc.details() or "")  # type: ignore[attr-defined]


# -- helpers ---------------------------------------------------------------------------------

SHORT, LONG = 8, 24  # s0 dies after 10 tokens: short streams never see it, long ones do


def baton(control: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI with `--control control`."""
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args, "--control", control],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip


def ok_json(out: subprocess.CompletedProcess[str]) -> Any:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def parts() -> Iterator[list[Part]]:
    started: list[Part] = []
    yield started
    for p in reversed(started):
        p.stop(grace=3)


@pytest.fixture
def replica() -> Iterator[Replica]:
    r = Replica("c2")
    yield r
    r.stop()


def started(parts: list[Part], part: Part) -> Part:
    parts.append(part)
    return part


# -- the tests -------------------------------------------------------------------------------


def test_shim_and_cli_find_the_leader_behind_a_follower(
    tmp_path: Path, parts: list[Part], replica: Replica
) -> None:
    sims = [started(parts, start_sim()) for _ in range(2)]
    config = write_config(tmp_path / "control.toml", [(f"s{i}", s.ready) for i, s in
                                                      enumerate(sims)])  # fmt: skip
    leader = started(parts, start_control(config))
    replica.follow("c1", leader.ready)
    log = tmp_path / "shim.log"
    # The follower first: the shim is refused, and finds the leader.
    shim = started(parts, start_shim(f"{replica.address},{leader.ready}", log=log))

    results = [stream(shim.ready, SHORT) for _ in range(10)]
    assert [r for r in results if not r.ok] == []  # 0 client errors
    assert replica.refused[WATCH] >= 1 and replica.routes == 0
    # Every request was routed by the leader, none from the shim's snapshot.
    assert control_metric(leader, "baton_routes_total") >= 10
    assert metric(shim.ready, "baton_shim_degraded_routes_total") == 0
    assert metric(shim.ready, "baton_shim_degraded") == 0
    assert f"control leader is now {leader.ready} (was {replica.address})" in log.read_text()

    # The CLI: a refusal names the leader, and the call is made there.
    both = f"{replica.address},{leader.ready}"
    assert {r["id"] for r in ok_json(baton(both, "backends", "list", "--json"))} == {"s0", "s1"}
    assert replica.refused[f"/{ADMIN.full_name}/ListBackends"] == 1
    # ... also when the leader it names is not among those given.
    assert len(ok_json(baton(replica.address, "backends", "list", "--json"))) == 2
    # An address down: the next one answers.
    down = f"127.0.0.1:{free_port()}"
    assert len(ok_json(baton(f"{down},{leader.ready}", "backends", "list", "--json"))) == 2
    # A change refused by the follower is applied by the leader, once.
    assert ok_json(baton(both, "backends", "drain", "s1", "--json"))["state"] == "draining"
    drains = [e for e in ok_json(baton(leader.ready, "events", "--kind", "admin", "--json"))
              if e.get("action") == "drain"]  # fmt: skip
    assert [e["backend_id"] for e in drains] == ["s1"]
    assert ok_json(baton(both, "backends", "undrain", "s1", "--json"))["state"] == "healthy"

    # Status: every replica answers it, and says who leads.
    status = ok_json(baton(both, "status", "--json"))
    assert status["control"] == replica.address and status["replica_id"] == "c2"
    assert status["leader"] == "c1" and status["store"].startswith("etcd://")
    assert status["replicas"] == [
        {"id": "c1", "address": leader.ready, "role": "leader"},
        {"id": "c2", "address": replica.address, "role": "follower"},
    ]
    text = baton(both, "status")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[1].startswith("replica c2 answered  leader c1  store etcd://")
    assert lines[2].split() == ["REPLICA", "ADDRESS", "ROLE"]
    assert lines[3].split() == ["c1", leader.ready, "leader"]
    assert lines[4].split() == ["c2", replica.address, "follower"]


PACE = ("--decode-ms-per-step", "4")  # ~0.1 s a long stream
GAP_REQUESTS, CONCURRENCY = 16, 4


def test_shim_follows_the_leader_when_it_moves(
    tmp_path: Path, parts: list[Part], replica: Replica
) -> None:
    sims = [
        started(parts, start_sim(*PACE, "--fault", "die-after=10")),
        started(parts, start_sim(*PACE)),
    ]
    config = write_config(tmp_path / "control.toml", [(f"s{i}", s.ready) for i, s in
                                                      enumerate(sims)])  # fmt: skip
    first = started(parts, start_control(config))
    second = started(parts, start_control(config))  # what the replica passes calls on to
    replica.follow("c1", first.ready)
    log = tmp_path / "shim.log"
    shim = started(parts, start_shim(f"{first.ready},{replica.address}", log=log)).ready

    def count(name: str) -> float:
        return metric(shim, name)

    assert all(stream(shim, SHORT).ok for _ in range(4))
    assert wait_until(lambda: count("baton_shim_buffered_outcomes") == 0, 10)
    assert control_metric(first, "baton_routes_total") >= 4

    # The leader's process dies; none leads for a while: the shim serves from its snapshot
    # and buffers what it reports (long streams die on s0 and are resumed on s1).
    first.kill()
    assert wait_until(lambda: count("baton_shim_degraded") == 1, 10)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        gap = list(pool.map(lambda _: stream(shim, LONG), range(GAP_REQUESTS)))
    assert [r for r in gap if not r.ok] == []  # 0 client errors
    # A failover is counted once its seam check (after the resumed stream's end) is done.
    assert wait_until(lambda: count("baton_shim_seam_checks_pending") == 0, 10)
    reported = count("baton_shim_failovers_total")
    assert reported >= 1
    assert count("baton_shim_buffered_reports") == reported
    buffered = count("baton_shim_buffered_outcomes")
    assert buffered >= GAP_REQUESTS
    assert replica.refused[WATCH] == 0  # not asked while it did not lead: health said so

    # The replica leads: the shim moves there, and what it buffered arrives there once.
    replica.lead(second.ready)
    assert wait_until(lambda: count("baton_shim_degraded") == 0, 10)
    assert wait_until(lambda: sum(replica.outcomes.values()) >= buffered, 10)
    assert wait_until(lambda: replica.failover_reports >= reported, 10)
    assert count("baton_shim_buffered_outcomes") == count("baton_shim_buffered_reports") == 0
    assert count("baton_shim_dropped_outcomes_total") == 0
    assert count("baton_shim_dropped_reports_total") == 0
    # None twice (a request's last outcomes may have been counted after `buffered` was read).
    assert sum(replica.outcomes.values()) >= buffered and set(replica.outcomes.values()) == {1}
    assert replica.failover_reports == reported
    events = ok_json(baton(replica.address, "events", "--kind", "failover", "--json"))
    assert len({(e["request_id"], e["attempt"], e["choice"]) for e in events}) == len(events)
    assert len(events) == reported
    assert f"control leader is now {replica.address} (was {first.ready})" in log.read_text()
    # And routes go to the new leader, not decided from the snapshot.
    local = count("baton_shim_degraded_routes_total")
    assert stream(shim, SHORT).ok
    assert count("baton_shim_degraded_routes_total") == local and replica.routes >= 1

    # The old leader's address comes back (a new process) and takes the lead: the replica
    # ends the shim's streams with its refusal, which names it; requests go on meanwhile.
    port = first.ready.rsplit(":", 1)[1]
    back = started(parts, start_control(config, "--listen", f"127.0.0.1:{port}"))
    moving = threading.Event()
    during: list[Streamed] = []

    def load() -> None:
        while not moving.is_set():
            during.append(stream(shim, SHORT))

    loader = threading.Thread(target=load)
    loader.start()
    try:
        assert wait_until(lambda: len(during) >= 2, 10)
        replica.follow("c1", back.ready)
        assert wait_until(lambda: control_metric(back, "baton_routes_total") >= 3, 10)
    finally:
        moving.set()
        loader.join(30)
    assert during and [r for r in during if not r.ok] == []  # 0 client errors
    assert replica.refused[ROUTE_STREAM] + replica.refused[WATCH] >= 1
    assert f"control leader is now {back.ready} (was {replica.address})" in log.read_text()
    assert wait_until(lambda: count("baton_shim_degraded") == 0, 10)


def test_shim_refuses_a_control_flag_without_an_address() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dataplane", "--control", " , ", "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode != 0 and "--control: no control address" in out.stderr
