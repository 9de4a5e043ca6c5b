"""Per-backend health as a pure state machine; time comes in as `now`, never read here.

healthy --(real failure: probe or shim report)--> demoted --(N failed probes)--> down
healthy --(M probes in a row that time out: alive, maybe only busy)--> demoted
demoted/down --(N consecutive good probes)--> healthy
any --(admin drain)--> draining --(undrain)--> healthy if the last probe was good, else demoted
"""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass, replace

from baton.model import Health, HealthState
from control.settings import HealthPolicy


@dataclass(frozen=True, slots=True)
class HealthRecord:
    health: Health
    ok_streak: int = 0
    fail_streak: int = 0
    slow_streak: int = 0  # the last probes that timed out, with no other failure since
    drained: bool = False

    @staticmethod
    def new(now: float) -> HealthRecord:
        # Optimistic start: a pre-first-byte failure costs one retry, and the prober corrects it.
        return HealthRecord(Health(HealthState.HEALTHY, "registered", now))


def _move(rec: HealthRecord, state: HealthState, reason: str, now: float) -> HealthRecord:
    if rec.health.state is state:
        return rec
    return replace(rec, health=Health(state, reason, now))


def probe_ok(rec: HealthRecord, now: float, policy: HealthPolicy) -> HealthRecord:
    rec = replace(rec, ok_streak=rec.ok_streak + 1, fail_streak=0, slow_streak=0)
    if rec.drained or rec.health.state is HealthState.HEALTHY:
        return rec
    if rec.ok_streak >= policy.readmit_after:
        return _move(rec, HealthState.HEALTHY, f"{rec.ok_streak} good probes", now)
    return rec


def probe_failed(
    rec: HealthRecord, reason: str, now: float, policy: HealthPolicy, *, slow: bool = False
) -> HealthRecord:
    """`slow`: the probe timed out (no answer yet) rather than failed."""
    rec = replace(rec, ok_streak=0, fail_streak=rec.fail_streak + 1,
                  slow_streak=rec.slow_streak + 1 if slow else 0)  # fmt: skip
    if rec.drained:
        return rec
    if rec.health.state is HealthState.HEALTHY:
        if _only_slow(rec, policy):
            return rec
        return _move(rec, HealthState.DEMOTED, f"probe: {reason}", now)
    if rec.health.state is HealthState.DEMOTED and rec.fail_streak >= policy.down_after:
        return _move(rec, HealthState.DOWN, f"probe: {reason}", now)
    return rec


def passive_failure(rec: HealthRecord, reason: str, now: float) -> HealthRecord:
    """A shim saw a real failure: demote at once, before the next probe."""
    rec = replace(rec, ok_streak=0)
    if rec.drained or rec.health.state is not HealthState.HEALTHY:
        return rec
    return _move(rec, HealthState.DEMOTED, reason, now)


def drain(rec: HealthRecord, now: float, reason: str = "drained by admin") -> HealthRecord:
    return _move(replace(rec, drained=True), HealthState.DRAINING, reason, now)


def undrain(rec: HealthRecord, now: float, policy: HealthPolicy) -> HealthRecord:
    rec = replace(rec, drained=False)
    if rec.fail_streak and not _only_slow(rec, policy):
        return _move(rec, HealthState.DEMOTED, "undrained; last probe failed", now)
    return _move(rec, HealthState.HEALTHY, "undrained by admin", now)


def _only_slow(rec: HealthRecord, policy: HealthPolicy) -> bool:
    """Every failed probe since the last good one timed out, fewer than slow_after of them:
    the engine answers its port and may only be busy."""
    return rec.fail_streak == rec.slow_streak < policy.slow_after
