"""The domain <-> protobuf border for backends: every field crosses both ways."""

from __future__ import annotations

import pytest

from baton import wire
from baton.model import Backend, BackendId, BackendKind, Failure, Role
from baton.v1 import fleet_pb2, routing_pb2
from control.api import convert
from control.backend_spec import make_backend

PARSED = Backend(BackendId("gpu-0"), "http://10.0.0.10:8000", "m", BackendKind.SGLANG,
                 Role.TARGET, "GPU0_KEY", "deepseek_r1", "hermes", "tcp://10.0.0.10:5557",
                 "tcp://10.0.0.10:5558")  # fmt: skip
PLAIN = Backend(BackendId("gpu-1"), "http://10.0.0.11:8000", "m")
# Rank 0 is a rank, not "none": it must cross as set.
RANK0 = Backend(BackendId("dp-0"), "http://10.0.0.12:8000", "m", data_parallel_rank=0)


@pytest.mark.parametrize("backend", [PARSED, PLAIN, RANK0], ids=["every-field", "defaults",
                                                                 "rank-0"])  # fmt: skip
def test_a_backend_round_trips_through_the_wire(backend: Backend) -> None:
    pb = fleet_pb2.Backend.FromString(wire.backend_to_pb(backend).SerializeToString())
    assert wire.backend_from_pb(pb) == backend
    assert make_backend(**convert.backend_fields_from_pb(pb)) == backend  # the admin path


def test_the_parsers_are_on_the_wire_under_their_names() -> None:
    pb = wire.backend_to_pb(PARSED)
    assert (pb.reasoning_parser, pb.tool_parser) == ("deepseek_r1", "hermes")
    fields = convert.backend_fields_from_pb(pb)
    assert (fields["reasoning_parser"], fields["tool_parser"]) == ("deepseek_r1", "hermes")


def test_the_kv_event_endpoints_are_on_the_wire_under_their_names() -> None:
    pb = wire.backend_to_pb(PARSED)
    assert (pb.kv_events, pb.kv_events_replay) == ("tcp://10.0.0.10:5557", "tcp://10.0.0.10:5558")
    fields = convert.backend_fields_from_pb(pb)
    assert (fields["kv_events"], fields["kv_events_replay"]) == (pb.kv_events, pb.kv_events_replay)


# -- failure classes: an enum on the wire, beside the string older peers read -----------------


@pytest.mark.parametrize("failure", [f for f in Failure if f is not Failure.UNKNOWN])
def test_a_failure_class_crosses_as_its_enum_and_its_string(failure: Failure) -> None:
    sent = routing_pb2.ReportAttemptFailureRequest(**wire.failure_fields(failure))
    got = routing_pb2.ReportAttemptFailureRequest.FromString(sent.SerializeToString())
    assert got.failure_class != routing_pb2.FAILURE_CLASS_UNSPECIFIED
    assert wire.failure_from_pb(got.failure_class, "") is failure  # a new control
    assert got.failure == failure.value  # what a control older than the enum reads
    assert wire.failure_from_pb(0, got.failure) is failure  # a new control, an old shim


def test_a_failure_class_this_side_does_not_know_is_still_a_failure() -> None:
    # A shim newer than this control sends a class it has no name for (enum value 99 and a
    # string it does not know): the backend is still the one that failed.
    assert wire.failure_from_pb(99, "cosmic_ray") is Failure.UNKNOWN
    assert wire.failure_from_pb(0, "") is Failure.UNKNOWN
    assert wire.failure_fields(Failure.UNKNOWN)["failure_class"] == 0
