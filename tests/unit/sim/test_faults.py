from __future__ import annotations

import pytest

from sim.faults import (
    DEFAULT_STALL_SECONDS,
    NO_FAULTS,
    FaultKind,
    FaultSpec,
    FaultSpecError,
    parse_fault_spec,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", NO_FAULTS),
        ("die-after=5", FaultSpec(die_after=5)),
        (" stall-after=3 , stall-seconds=0.5 ", FaultSpec(stall_after=3, stall_seconds=0.5)),
        ("exit-after=0", FaultSpec(exit_after=0)),
        ("error-after=2,abort-after=9", FaultSpec(error_after=2, abort_after=9)),
        ("reset-after=1", FaultSpec(reset_after=1)),
        ("status=503", FaultSpec(status=503)),
        ("garbage", FaultSpec(garbage=True)),
        ("garbage=1", FaultSpec(garbage=True)),
        ("garbage=0", FaultSpec(garbage=False)),
        ("none", FaultSpec(clear=True)),
    ],
)
def test_parse(text: str, expected: FaultSpec) -> None:
    assert parse_fault_spec(text) == expected


@pytest.mark.parametrize(
    "text", ["bogus=1", "die-after", "die-after=x", "die-after=-1", "status=42", "stall-seconds=a"]
)
def test_parse_rejects_bad_specs(text: str) -> None:
    with pytest.raises(FaultSpecError):
        parse_fault_spec(text)


def test_due_fires_at_exactly_n_emitted_tokens_with_precedence() -> None:
    spec = FaultSpec(stall_after=2, die_after=2, error_after=4)
    assert [spec.due(n) for n in range(5)] == [None, None, FaultKind.DIE, None, FaultKind.ERROR]
    assert FaultSpec(exit_after=1, die_after=1).due(1) is FaultKind.EXIT


def test_request_spec_overrides_process_spec_per_key() -> None:
    base = FaultSpec(die_after=5, stall_seconds=2.0)
    assert FaultSpec(die_after=1).over(base) == FaultSpec(die_after=1, stall_seconds=2.0)
    assert FaultSpec(error_after=3).over(base) == FaultSpec(
        die_after=5, error_after=3, stall_seconds=2.0
    )
    assert parse_fault_spec("none").over(base).empty
    assert parse_fault_spec("none,abort-after=1").over(base) == FaultSpec(abort_after=1)


def test_stall_defaults_to_an_hour() -> None:
    assert FaultSpec(stall_after=1).stall_for == DEFAULT_STALL_SECONDS
    assert FaultSpec(stall_after=1, stall_seconds=0.25).stall_for == 0.25
