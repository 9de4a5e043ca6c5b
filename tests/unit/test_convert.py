"""The domain <-> protobuf border for backends: every field crosses both ways."""

from __future__ import annotations

import pytest

from baton.v1 import fleet_pb2
from control.config import make_backend
from control.model import Backend, BackendId, BackendKind, Role
from control.services import convert

PARSED = Backend(BackendId("gpu-0"), "http://10.0.0.10:8000", "m", BackendKind.SGLANG,
                 Role.TARGET, "GPU0_KEY", "deepseek_r1", "hermes")  # fmt: skip
PLAIN = Backend(BackendId("gpu-1"), "http://10.0.0.11:8000", "m")


@pytest.mark.parametrize("backend", [PARSED, PLAIN], ids=["parsers", "defaults"])
def test_a_backend_round_trips_through_the_wire(backend: Backend) -> None:
    wire = fleet_pb2.Backend.FromString(convert.backend_to_pb(backend).SerializeToString())
    assert convert.backend_from_pb(wire) == backend
    assert make_backend(**convert.backend_fields_from_pb(wire)) == backend  # the admin path


def test_the_parsers_are_on_the_wire_under_their_names() -> None:
    wire = convert.backend_to_pb(PARSED)
    assert (wire.reasoning_parser, wire.tool_parser) == ("deepseek_r1", "hermes")
    fields = convert.backend_fields_from_pb(wire)
    assert (fields["reasoning_parser"], fields["tool_parser"]) == ("deepseek_r1", "hermes")
