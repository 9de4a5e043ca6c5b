from __future__ import annotations

from pathlib import Path

import orjson

from baton.model import FailoverOutcome, Failure, ResumePath, Seam
from control.audit.durable import EventFile
from control.audit.log import Event, EventLog, EventQuery
from control.audit.payloads import Admin, EventKind, Failover, Retry

FAILOVER = Failover(trace_id="", from_backend="b", to_backend="a", failure=Failure.TRUNCATED,
                    choice=0, tokens_sent=7, path=ResumePath.TOKEN, seam=Seam.VERIFIED,
                    gap_ms=1.5, attempt=1, outcome=FailoverOutcome.RESUMED)  # fmt: skip


def test_events_survive_a_restart_and_numbering_carries_on(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    store = EventFile(path)
    log = EventLog(lambda: 100.0, sink=store.append)
    log.record(Admin(action="drain", migrate=False), backend_id="a")
    log.record(Retry(failure=Failure.CONNECT), request_id="r1", backend_id="b")
    store.close()

    again = EventFile(path)
    restored = EventLog(lambda: 200.0, sink=again.append, restored=again.load(1000))
    assert [(e.seq, e.kind, e.backend_id) for e in restored] == [
        (1, EventKind.ADMIN, "a"),
        (2, EventKind.RETRY, "b"),
    ]
    assert restored.query(EventQuery(kind="retry"))[0].data == {"failure": "connect", "detail": ""}
    assert restored.record(Admin(action="remove")).seq == 3
    again.close()


def test_rotation_keeps_the_newest_files_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    store = EventFile(path, max_bytes=400, keep=2)
    log = EventLog(lambda: 1.0, sink=store.append)
    for i in range(40):
        log.record_route(
            f"r{i}",
            backend_id="b",
            reason="spread",
            policy="adaptive",
            model="m",
            pin_depth=0,
            snapshot=1,
        )
        if i % 4 == 3:
            store.flush()  # control flushes a few times a second
    store.close()
    assert path.with_name("events.jsonl.1").exists() and path.with_name("events.jsonl.2").exists()
    assert not path.with_name("events.jsonl.3").exists()  # only `keep` rotated files
    with open(path, "ab") as f:
        f.write(b'{"v": 1, "seq": 41, "ti')  # a crash mid-write
    loaded = list(EventLog(lambda: 2.0, restored=EventFile(path).load(1000)))
    seqs = [e.seq for e in loaded]
    assert seqs == sorted(seqs) and seqs[-1] == 40  # newest kept, in order, torn line gone
    assert len(seqs) < 40  # the oldest rotated away
    assert list(EventLog(lambda: 2.0, restored=EventFile(path).load(5)))[-1].request_id == "r39"


def test_route_decisions_read_back_whole_and_in_order_among_other_events(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    store = EventFile(path)
    log = EventLog(lambda: 5.0, sink=store.append)
    followed: list[Event] = []
    log.subscribe(followed.append)
    log.record_route(
        "r1",
        backend_id="a",
        reason="least_loaded",
        policy="adaptive",
        model="m",
        pin_depth=0,
        snapshot=7,
    )
    log.record_route(
        "r2",
        backend_id="b",
        reason="pin_hit",
        policy="adaptive",
        model="m",
        pin_depth=2,
        snapshot=7,
        tenant="acme",
    )
    log.record(FAILOVER, request_id="r2", backend_id="b")
    log.record_route(
        "r3",
        backend_id="a",
        reason="failover",
        policy="adaptive",
        model="m",
        pin_depth=0,
        snapshot=8,
    )
    store.close()

    restored = EventLog(lambda: 6.0, restored=EventFile(path).load(1000))
    events = list(restored)
    assert [(e.seq, e.kind, e.request_id) for e in events] == [
        (1, EventKind.ROUTE, "r1"),
        (2, EventKind.ROUTE, "r2"),
        (3, EventKind.FAILOVER, "r2"),
        (4, EventKind.ROUTE, "r3"),
    ]
    assert events[1].to_json() == {
        "v": 1, "seq": 2, "time": 5.0, "kind": "route", "request_id": "r2", "backend_id": "b",
        "reason": "pin_hit", "policy": "adaptive", "model": "m", "pin_depth": 2, "snapshot": 7,
        "detail": "", "tenant": "acme",
    }  # fmt: skip
    assert followed == events  # live followers see the same events as a later reader
    assert [e.seq for e in restored.query(EventQuery(kind="route", backend_id="a"))] == [1, 4]
    assert [e.seq for e in restored.query(EventQuery(kind="failover"))] == [3]


def test_events_other_than_routes_reach_the_file_at_once(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    store = EventFile(path)
    log = EventLog(lambda: 1.0, sink=store.append, durable=store.flush)
    log.record_route(
        "r1", backend_id="a", reason="spread", policy="adaptive", model="m", pin_depth=0, snapshot=1
    )
    assert path.read_bytes() == b""  # decisions wait for the periodic flush
    log.record(FAILOVER, request_id="r1", backend_id="a")
    # Read by another reader without close(): what a SIGKILL would leave behind.
    seen = list(EventLog(lambda: 2.0, restored=EventFile(path).load(10)))
    assert [e.kind for e in seen] == [EventKind.ROUTE, EventKind.FAILOVER]


def test_route_rows_written_before_the_detail_column_still_read(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    old = {"v": 1, "kind": "route",
           "columns": ["seq", "time", "request_id", "backend_id", "reason", "policy", "model",
                       "pin_depth", "snapshot"],
           "rows": [[1, 2.0, "r1", "a", "spread", "adaptive", "m", 0, 3]]}  # fmt: skip
    path.write_bytes(orjson.dumps(old) + b"\n")
    (event,) = list(EventLog(lambda: 6.0, restored=EventFile(path).load(10)))
    assert event.request_id == "r1" and event.data["reason"] == "spread"
    assert event.data["detail"] == "" and event.data["tenant"] == ""


def test_route_rows_written_before_the_tenant_column_still_read(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    old = {"v": 1, "kind": "route",
           "columns": ["seq", "time", "request_id", "backend_id", "reason", "policy", "model",
                       "pin_depth", "snapshot", "detail"],
           "rows": [[1, 2.0, "r1", "a", "spread", "adaptive", "m", 0, 3, "why"]]}  # fmt: skip
    path.write_bytes(orjson.dumps(old) + b"\n")
    (event,) = list(EventLog(lambda: 6.0, restored=EventFile(path).load(10)))
    assert event.data["detail"] == "why" and event.data["tenant"] == ""
