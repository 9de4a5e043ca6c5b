"""The durable audit log has one schema per kind of event: what control writes for each kind,
read back from the file as an operator's tool would, holds exactly its payload's fields
(control/audit/payloads.py) with their types, and nothing a call site made up."""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, fields
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import orjson

from baton.model import Failure
from baton.v1 import routing_pb2
from control.api.convert import failover_event
from control.audit.durable import EventFile
from control.audit.log import EventLog
from control.audit.payloads import PAYLOADS, EventKind, Payload
from control.backend_spec import make_backend
from control.fleet.registry import Registry
from control.routing.policy import make_policy
from control.routing.router import Router

BASE = {"v", "seq", "time", "kind", "request_id", "backend_id"}
SCHEMA: dict[str, type[Payload]] = {p.KIND.value: p for p in PAYLOADS}


def written_as(value: Any, t: Any) -> bool:
    """Whether a JSON value is what a field of type `t` writes (an enum: one of its values;
    a Literal: one of its strings)."""
    if typing.get_origin(t) is Literal:
        return value in typing.get_args(t)
    if isinstance(t, type) and issubclass(t, Enum):
        return value in {m.value for m in t}
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, t) and not (t is int and isinstance(value, bool))


def schema_errors(row: dict[str, Any]) -> list[str]:
    """What is wrong with one JSON row of a non-route event, against its kind's payload."""
    payload = SCHEMA.get(row.get("kind", ""))
    if payload is None:
        return [f"unknown kind {row.get('kind')!r}"]
    hints = typing.get_type_hints(payload)
    declared = {f.name: f for f in fields(payload)}
    errors = [f"{k}: not in {payload.__name__}" for k in row if k not in BASE | set(declared)]
    for name, f in declared.items():
        if name not in row:
            if f.default is MISSING:
                errors.append(f"{name}: required by {payload.__name__}, missing")
            continue
        union = typing.get_origin(hints[name]) in (typing.Union, types.UnionType)
        allowed = typing.get_args(hints[name]) if union else (hints[name],)
        value = row[name]
        ok = any(written_as(value, t) for t in allowed if t is not type(None))
        if not ok:
            errors.append(f"{name}: {value!r} is not {hints[name]}")
    return errors


def test_every_kind_control_writes_reads_back_in_its_schema(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    store = EventFile(path)
    now = [1000.0]
    events = EventLog(lambda: now[0], sink=store.append, durable=store.flush)
    backends = [make_backend(b, f"http://127.0.0.1:1/{b}", "m") for b in "abc"]
    registry = Registry(backends, clock=lambda: now[0], events=events)
    router = Router(registry, make_policy("adaptive"),
                    clock=lambda: now[0], route_events=False)  # fmt: skip
    # admin: add, drain (with and without migrate), undrain, remove
    registry.add(make_backend("d", "http://127.0.0.1:1/d", "m", role="serve"))
    registry.drain("d", migrate=True)
    registry.undrain("d")
    registry.drain("d")
    registry.remove("d")
    # health: a shim's report demotes, failed probes take it down, good ones readmit it
    router.attempt_failed("r1", "a", Failure.CONNECT, "refused")  # a retry, and a demotion
    for ok in (False, False, False, True, True):
        now[0] += 1
        registry.probe_result("a", ok, "" if ok else "refused")
    # a failover as a shim reports it
    report = routing_pb2.ReportFailoverRequest(
        request_id="r2", from_backend_id="b", to_backend_id="c", failure="truncated",
        failure_class=routing_pb2.FAILURE_CLASS_TRUNCATED, choice_index=0, tokens_sent=17,
        path=routing_pb2.RESUME_PATH_TOKEN, seam=routing_pb2.SEAM_VERDICT_VERIFIED, gap_ms=3.25,
        attempt=1, outcome=routing_pb2.FAILOVER_OUTCOME_RESUMED,
    )  # fmt: skip
    events.record(failover_event(report), request_id="r2", backend_id="b")
    store.close()

    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line]
    kinds = [r["kind"] for r in rows]
    assert {EventKind.ADMIN, EventKind.RETRY, EventKind.HEALTH, EventKind.FAILOVER} <= set(kinds)
    assert [(r["kind"], e) for r in rows for e in schema_errors(r)] == []
    actions = [r["action"] for r in rows if r["kind"] == "admin"]
    assert actions == ["add", "drain", "undrain", "drain", "remove"]
    (failover,) = (r for r in rows if r["kind"] == "failover")
    assert (failover["failure"], failover["seam"], failover["tokens_sent"]) == (
        "truncated", "verified", 17,
    )  # fmt: skip


def test_the_schema_check_catches_rows_a_call_site_made_up() -> None:
    good = {"v": 1, "seq": 1, "time": 0.0, "kind": "retry", "request_id": "r", "backend_id": "a",
            "failure": "connect", "detail": ""}  # fmt: skip
    assert schema_errors(good) == []
    assert schema_errors({**good, "to": "b"}) == ["to: not in Retry"]
    assert schema_errors({k: v for k, v in good.items() if k != "failure"}) == [
        "failure: required by Retry, missing"
    ]
    assert schema_errors({**good, "failure": 3}) == ["failure: 3 is not <enum 'Failure'>"]
    assert schema_errors({**good, "failure": "gone"}) == ["failure: 'gone' is not <enum 'Failure'>"]
    assert schema_errors({**good, "kind": "gossip"}) == ["unknown kind 'gossip'"]
