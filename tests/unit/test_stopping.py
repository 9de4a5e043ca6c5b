"""The shim's stop signals: a repeat of the first within REPEAT_S is not an operator's
second Ctrl-C (one SIGTERM was seen to reach the handler twice, 1 ms apart), so it must not
cut the in-flight streams' grace short; a later one does."""

from __future__ import annotations

from dataplane.edge.lifecycle import REPEAT_S, Stopping


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_signal_stops_and_a_quick_repeat_does_not_hurry() -> None:
    clock = Clock()
    s = Stopping(clock)
    s.signalled()
    assert s.stop.is_set() and not s.hurry.is_set()
    clock.now += 0.001
    s.signalled()
    assert not s.hurry.is_set()


def test_a_second_signal_later_cuts_the_grace_short() -> None:
    clock = Clock()
    s = Stopping(clock)
    s.signalled()
    clock.now += REPEAT_S
    s.signalled()
    assert s.hurry.is_set()
