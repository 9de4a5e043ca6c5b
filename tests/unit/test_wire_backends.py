"""The shim's Backends kept from control's answers: the same backend comes back as the same
object, and a backend that changed under its id (re-added with another url, drained into
another role...) comes back changed, never as the one kept."""

from __future__ import annotations

from baton import wire
from baton.model import Backend, BackendId, BackendKind, Role
from baton.v1 import routing_pb2


def answer(*backends: Backend) -> routing_pb2.RouteResponse:
    return routing_pb2.RouteResponse(backends=[wire.backend_to_pb(b) for b in backends])


def test_a_decision_read_with_kept_backends_equals_one_read_afresh() -> None:
    a = Backend(BackendId("a"), "http://127.0.0.1:1", "m")
    b = Backend(BackendId("b"), "http://127.0.0.1:2", "m", BackendKind.OPENAI, Role.TARGET)
    kept = wire.Backends()
    first = wire.decision_from_pb(answer(a, b), kept)
    again = wire.decision_from_pb(answer(b, a), kept)
    assert first == wire.decision_from_pb(answer(a, b))
    assert again.backends == (b, a)
    assert again.backends[1] is first.backends[0]  # kept, not built again


def test_a_backend_changed_under_its_id_is_read_anew() -> None:
    kept = wire.Backends()
    old = Backend(BackendId("a"), "http://127.0.0.1:1", "m")
    new = Backend(BackendId("a"), "http://127.0.0.1:9", "m", data_parallel_rank=1)
    assert wire.decision_from_pb(answer(old), kept).backends == (old,)
    assert wire.decision_from_pb(answer(new), kept).backends == (new,)
    assert wire.decision_from_pb(answer(old), kept).backends == (old,)
