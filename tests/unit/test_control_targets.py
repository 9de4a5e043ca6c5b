"""Control replicas (`--control A,B,C`) as the shim and the CLI read them: the addresses, the
order the shim's probe asks them in, a replica's "not the leader" refusal told from control's
other refusals; what the link does with a refusal (a report kept, a call marking control away,
the Leader heeding only the replica it talks to, the RouteStream moved to the new leader with
its outcomes and without its questions), where the CLI makes a refused call again, and
`baton status` with replicas."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from baton.replicas import leader_in, says_not_leader, split_targets
from baton.v1 import routing_pb2
from clients import render
from clients.client import AdminClient, AdminError, leader_named
from clients.client import split_targets as cli_targets
from dataplane.exceptions import ControlUnavailable, StreamBroken
from dataplane.link.calls import Calls
from dataplane.link.leader import Leader
from dataplane.link.outbox import Outbox, Report, not_leader
from dataplane.link.routestream import RouteStream
from dataplane.link.targets import probe_order

FP = grpc.StatusCode.FAILED_PRECONDITION
REFUSAL = "control replica c2 is not the leader: the leader is c1 at 10.0.0.1:50061"


def rpc_error(
    code: grpc.StatusCode, details: str = "", leader: str = ""
) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(("baton-leader", leader)) if leader else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


# -- addresses and probe order (dataplane/link/targets.py) ----------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:50051", ("127.0.0.1:50051",)),
        ("a:1,b:2,c:3", ("a:1", "b:2", "c:3")),
        (" a:1 , ,b:2,a:1,", ("a:1", "b:2")),  # blanks dropped, a repeat once, order kept
        ("[::1]:1,[::1]:2", ("[::1]:1", "[::1]:2")),
        ("dns:///control:50051", ("dns:///control:50051",)),
        # gRPC's own address list: one target, balanced by gRPC
        ("ipv4:10.0.0.1:1,10.0.0.2:1", ("ipv4:10.0.0.1:1,10.0.0.2:1",)),
    ],
)
def test_split_targets(text: str, want: tuple[str, ...]) -> None:
    assert split_targets(text) == want
    assert cli_targets(text) == want  # the CLI reads --control the same way


@pytest.mark.parametrize("text", ["", " ", ",", " , ,"])
def test_no_address_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match="no control address"):
        split_targets(text)
    with pytest.raises(AdminError, match="--control: no control address"):
        cli_targets(text)


@pytest.mark.parametrize(
    ("targets", "current", "leader", "want"),
    [
        (("a",), "a", "", ("a",)),  # one control: only it, as ever
        (("a", "b", "c"), "a", "", ("a", "b", "c")),
        (("a", "b", "c"), "b", "", ("b", "c", "a")),  # where it was first, then in turn
        (("a", "b", "c"), "a", "c", ("c", "a", "b")),  # the leader a refusal named first
        (("a", "b", "c"), "a", "a", ("a", "b", "c")),
        (("a", "b"), "a", "x", ("x", "a", "b")),  # named, though not given
        (("a", "b"), "x", "", ("x", "a", "b")),  # moved to such a one earlier
    ],
)
def test_probe_order(
    targets: tuple[str, ...], current: str, leader: str, want: tuple[str, ...]
) -> None:
    assert probe_order(targets, current, leader) == want


def test_a_refusal_names_the_leader_in_trailing_metadata() -> None:
    assert leader_in([("other", "x"), ("baton-leader", "h:1")]) == "h:1"
    assert leader_in([("baton-leader", b"h:1")]) == "h:1"
    assert leader_in(None) == leader_in([]) == ""
    assert says_not_leader(REFUSAL, "")  # no leader known: told by the details
    assert says_not_leader("", "h:1")
    assert not says_not_leader("pair refused: draft and target disagree", "")


def test_not_leader_tells_a_replicas_refusal_from_control_refusing_the_call() -> None:
    assert not_leader(rpc_error(FP, REFUSAL, "10.0.0.1:50061")) == "10.0.0.1:50061"
    assert not_leader(rpc_error(FP, "control replica c2 is not the leader: no leader")) == ""
    assert not_leader(rpc_error(FP, "pair refused")) is None  # control's own refusal
    assert not_leader(rpc_error(grpc.StatusCode.UNAVAILABLE, REFUSAL, "h:1")) is None


# -- what the link does with a refusal ------------------------------------------------------


def test_a_report_refused_by_a_follower_is_kept_for_the_leader() -> None:
    async def scenario() -> tuple[list[int], int, dict[str, int]]:
        up = asyncio.Event()
        up.set()
        leading = False
        taken: list[int] = []

        def report(n: int) -> Report:
            async def send() -> None:
                if n < 0:
                    raise rpc_error(FP, "pair refused")  # not a replica's: dropped
                if not leading:
                    raise rpc_error(FP, REFUSAL, "h:1")
                taken.append(n)

            return Report("failover", send)

        away = asyncio.Event()

        def unreachable(why: str) -> None:
            up.clear()
            away.set()

        box = Outbox(10, up=up, on_unreachable=unreachable)
        for n in (1, -1, 2):
            box.put(report(n))
        await asyncio.wait_for(away.wait(), 5)  # the first report's refusal says "away"
        assert len(box) == 3 and taken == [] and box.rejected == 0
        leading = True
        up.set()  # what the probe does once it has found the leader
        await box.close(grace=5.0)
        return taken, box.rejected, box.dropped

    assert asyncio.run(scenario()) == ([1, 2], 1, {})


class RefusingStub:
    """GatePairing answers with `error`, once `release` is set."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self.error = error
        self.asked = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()

    async def GatePairing(self, request: Any, timeout: float, metadata: Any) -> Any:
        self.asked.set()
        await self.release.wait()
        raise self.error


class Following:
    """What Calls needs of the link's Leader: the stub a call goes to, `up`, and where a
    failure is told, with the stub it went to."""

    def __init__(self, stub: Any) -> None:
        self.stub = stub
        self.up = asyncio.Event()
        self.up.set()
        self.told: list[tuple[str, str, Any]] = []

    def unreachable(self, reason: str, leader: str = "", via: object = None) -> None:
        self.told.append((reason, leader, via))


def test_a_call_refused_by_a_follower_marks_control_away_and_names_the_leader() -> None:
    async def scenario() -> None:
        refusing = RefusingStub(rpc_error(FP, REFUSAL, "h:1"))
        control = Following(refusing)
        calls = Calls(control, (), 1.0)
        with pytest.raises(ControlUnavailable):
            await calls.gate_pairing("r", "p", "t", 4, 2)
        assert control.told == [("gate: FAILED_PRECONDITION", "h:1", refusing)]
        # The leader moves while a call is out: its failure names the replica it went to
        # (the Leader ignores it), and the next call goes to the new one.
        left = RefusingStub(rpc_error(grpc.StatusCode.UNAVAILABLE))
        left.release.clear()
        control.stub = left
        asking = asyncio.create_task(calls.gate_pairing("r", "p", "t", 4, 2))
        await left.asked.wait()
        control.stub = now = RefusingStub(rpc_error(FP, "pair refused"))
        left.release.set()
        with pytest.raises(ControlUnavailable):
            await asking
        assert control.told[1:] == [("gate: UNAVAILABLE", "", left)]
        with pytest.raises(ControlUnavailable):
            await calls.gate_pairing("r", "p", "t", 4, 2)
        assert now.asked.is_set() and len(control.told) == 2  # control's own refusal
        control.up.clear()
        with pytest.raises(ControlUnavailable, match="unreachable"):
            await calls.record_owner("r", "resp_1", "b1", "toy")

    asyncio.run(scenario())


def test_the_leader_hears_only_of_the_replica_it_talks_to() -> None:
    async def scenario() -> None:
        downs: list[str] = []
        leader = Leader(
            "127.0.0.1:1,127.0.0.1:2",
            tls_ca=None,
            timeout=0.1,
            probe_interval=60.0,
            on_down=downs.append,
            on_move=lambda to: None,
            on_back=lambda was, now, away: None,
        )
        assert leader.several and leader.at.address == "127.0.0.1:1"
        leader.unreachable("left", "127.0.0.1:2", via=object())  # a replica it has left
        assert leader.up.is_set() and downs == [] and leader.outages == 0
        leader.unreachable("gone", via=leader.stub)
        leader.unreachable("still gone")  # one outage, told once
        assert not leader.up.is_set() and downs == ["gone"] and leader.outages == 1
        await leader.close()

        closing = Leader("127.0.0.1:1", tls_ca=None, timeout=0.1, probe_interval=60.0,
                         on_down=downs.append, on_move=lambda to: None,
                         on_back=lambda was, now, away: None)  # fmt: skip
        assert not closing.several
        closing.closing()
        closing.unreachable("closed by us")  # the link closing: not an outage
        assert closing.up.is_set() and closing.outages == 0
        await closing.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))


class FakeCall:
    """One RouteStream call: what was written on it; answers nothing. `hold`: a write waits
    until the call is cancelled (a control that stopped reading)."""

    def __init__(self, hold: bool) -> None:
        self.sent: list[routing_pb2.RouteStreamRequest] = []
        self.writing = asyncio.Event()
        self.cancelled = asyncio.Event()
        self._hold = hold

    async def write(self, msg: routing_pb2.RouteStreamRequest) -> None:
        self.writing.set()
        if self._hold:
            await self.cancelled.wait()
        if self.cancelled.is_set():
            raise asyncio.InvalidStateError
        self.sent.append(msg)

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> routing_pb2.RouteStreamResponse:
        await self.cancelled.wait()
        raise StopAsyncIteration

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled.set()


class FakeStub:
    def __init__(self, hold: bool = False) -> None:
        self.calls: list[FakeCall] = []
        self.opened = asyncio.Event()
        self._hold = hold

    def RouteStream(self, metadata: Any = ()) -> FakeCall:
        self.calls.append(FakeCall(self._hold))
        self.opened.set()
        return self.calls[-1]


def test_retarget_moves_the_routestream_with_its_outcomes_not_its_questions() -> None:
    async def scenario() -> None:
        old, new = FakeStub(hold=True), FakeStub()
        broken: list[str] = []
        stream = RouteStream(old, max_outcomes=10, timeout=5.0,  # type: ignore[arg-type]
                             on_broken=lambda why, leader: broken.append(why))  # fmt: skip
        route = routing_pb2.RouteRequest
        first = asyncio.create_task(stream.route(route(request_id="r1")))
        await old.opened.wait()
        await old.calls[0].writing.wait()  # r1 is being written; control reads nothing
        second = asyncio.create_task(stream.route(route(request_id="r2")))  # queued behind
        stream.report(routing_pb2.RequestOutcome(request_id="o1"))  # queued, not yet sent
        await asyncio.sleep(0)
        stream.retarget(new)  # type: ignore[arg-type]
        for asking in (first, second):  # at once, not after the route timeout
            with pytest.raises(StreamBroken, match="leader moved"):
                await asking
        assert old.calls[0].cancelled.is_set()
        stream.flush()  # what the link does once it has moved (a no-op if gone already)
        await new.opened.wait()
        await new.calls[0].writing.wait()
        sent = [m for call in new.calls for m in call.sent]
        assert [o.request_id for m in sent for o in m.outcomes] == ["o1"]  # once, there
        assert [r.request_id for m in sent for r in m.routes] == []  # not asked again
        assert len(old.calls) == 1 and old.calls[0].sent == []
        assert broken == []  # a move is not an outage
        await stream.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))


# -- the CLI: where a refused call is made again ---------------------------------------------


class SyncError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, leader: str = "") -> None:
        self._code, self._leader = code, leader

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "refused"

    def trailing_metadata(self) -> tuple[Any, ...]:
        class M:
            key, value = "baton-leader", self._leader

        return (M(),) if self._leader else ()


def test_cli_makes_a_refused_call_again_only_where_nothing_was_applied() -> None:
    client = AdminClient("a:1,b:2,c:3", token="")
    assert client.target == "a:1"
    unavailable = SyncError(grpc.StatusCode.UNAVAILABLE)
    refused = SyncError(FP, "b:2")
    assert leader_named(refused) == "b:2" and leader_named(unavailable) == ""
    # The leader a replica named, once.
    assert client._again(refused, {"a:1"}, redirected=False) == "b:2"
    assert client._again(refused, {"a:1", "b:2"}, redirected=True) is None
    # Not reached: the next address not tried yet, in turn.
    assert client._again(unavailable, {"a:1"}, redirected=False) == "b:2"
    client.target = "c:3"
    assert client._again(unavailable, {"c:3"}, redirected=False) == "a:1"
    assert client._again(unavailable, {"a:1", "b:2", "c:3"}, redirected=False) is None
    # Anything else may have been applied: never again.
    for code in (grpc.StatusCode.DEADLINE_EXCEEDED, FP, grpc.StatusCode.INTERNAL):
        assert client._again(SyncError(code), {"c:3"}, redirected=False) is None
    client.close()


def test_status_shows_replicas_only_when_there_are() -> None:
    base = {"control": "a:1", "version": "1", "routing_policy": "adaptive",
            "snapshot_version": 3, "in_flight": 0, "uptime_seconds": 1.0,
            "models": [{"model": "toy", "backends": 2, "healthy": 2}],
            "replica_id": "", "leader": "", "store": "", "replicas": []}  # fmt: skip
    single = render.status(base).splitlines()
    assert len(single) == 3 and single[1].split() == ["MODEL", "BACKENDS", "HEALTHY"]
    replicas = [{"id": "c1", "address": "a:1", "role": "leader"},
                {"id": "c2", "address": "b:2", "role": "follower"}]  # fmt: skip
    told = {"replica_id": "c2", "leader": "c1", "store": "etcd://e:2379: ok", "replicas": replicas}
    lines = render.status({**base, **told}).splitlines()
    assert lines[1] == "replica c2 answered  leader c1  store etcd://e:2379: ok"
    assert [line.split() for line in lines[2:5]] == [
        ["REPLICA", "ADDRESS", "ROLE"], ["c1", "a:1", "leader"], ["c2", "b:2", "follower"]
    ]
    assert lines[5].split() == ["MODEL", "BACKENDS", "HEALTHY"]
    nobody = render.status({**base, "replicas": replicas[1:], "replica_id": "c2"})
    assert "leader none elected" in nobody
