from __future__ import annotations

from pathlib import Path

from control.events import EventKind, EventLog, EventQuery
from control.store import EventFile


def test_events_survive_a_restart_and_numbering_carries_on(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    store = EventFile(path)
    log = EventLog(lambda: 100.0, sink=store.append)
    log.record(EventKind.ADMIN, backend_id="a", action="drain")
    log.record(EventKind.RETRY, request_id="r1", backend_id="b", failure="connect")
    store.close()

    again = EventFile(path)
    restored = EventLog(lambda: 200.0, sink=again.append, restored=again.load(1000))
    assert [(e.seq, e.kind, e.backend_id) for e in restored] == [
        (1, EventKind.ADMIN, "a"),
        (2, EventKind.RETRY, "b"),
    ]
    assert restored.query(EventQuery(kind="retry"))[0].data == {"failure": "connect"}
    assert restored.record(EventKind.ADMIN, action="add").seq == 3
    again.close()


def test_rotation_keeps_the_newest_files_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    store = EventFile(path, max_bytes=400, keep=2)
    log = EventLog(lambda: 1.0, sink=store.append)
    for i in range(40):
        log.record(EventKind.ROUTE, request_id=f"r{i}", reason="spread")
        if i % 4 == 3:
            store.flush()  # control flushes a few times a second
    store.close()
    assert path.with_name("events.jsonl.1").exists() and path.with_name("events.jsonl.2").exists()
    assert not path.with_name("events.jsonl.3").exists()  # only `keep` rotated files
    with open(path, "ab") as f:
        f.write(b'{"v": 1, "seq": 41, "ti')  # a crash mid-write
    loaded = EventFile(path).load(1000)
    seqs = [e.seq for e in loaded]
    assert seqs == sorted(seqs) and seqs[-1] == 40  # newest kept, in order, torn line gone
    assert len(seqs) < 40  # the oldest rotated away
    assert EventFile(path).load(5)[-1].request_id == "r39"
