"""What one discovery source's view asks of the fleet: the endpoints it sees now against the
backends it added before, as actions for the registry. Pure: the runner applies them.

- ready, unknown -> Add (once its model is known); ready again after a demotion -> Undrain
- not ready or terminating, unknown, but seen ready before (a leader has had it in the fleet:
  this replica was just elected, and a follower's registry holds no discovered backend) ->
  Add, then Drain as below, so that its streams still move
- not ready -> Drain (no new requests; its streams finish where they are)
- terminating -> Drain with migrate: its streams move to other backends now, before the
  engine's SIGTERM, through the same resume as `baton backends drain --migrate`
- gone -> Remove. For a DNS name, whose records say nothing of a shutdown, a record gone is
  first a migrating drain, and the backend is removed once no request is left on it.
- the endpoint's url, model or engine changed -> Remove, then Add as it is now

Only backends whose source is this one are touched: the config file's and an operator's stay
as they are, and an id one of them holds already is refused, never taken over."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baton.model import Backend, BackendId, BackendStatus, HealthState
from control.discovery.endpoints import Phase


@dataclass(frozen=True, slots=True)
class Wanted:
    phase: Phase
    backend: Backend | None  # None: its model is not known yet
    # Ready at some time since its source listed it: the leader then will have added it.
    was_ready: bool = False


@dataclass(frozen=True, slots=True)
class Add:
    backend: Backend


@dataclass(frozen=True, slots=True)
class Remove:
    id: str


@dataclass(frozen=True, slots=True)
class Drain:
    id: str
    migrate: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Undrain:
    id: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """An endpoint that cannot join: a backend of another source holds its id."""

    id: str
    holder: str


Action = Add | Remove | Drain | Undrain | Refuse


def reasons(source: str) -> tuple[str, str, str]:
    """The health reasons this source's drains give: not ready, terminating, gone."""
    return (f"not ready ({source})", f"terminating ({source})", f"gone from {source}")


def plan(
    source: str,
    wanted: Mapping[str, Wanted],
    fleet: Sequence[BackendStatus],
    in_flight: Mapping[BackendId, int],
    *,
    linger: bool = False,
) -> list[Action]:
    """`fleet`: every backend as the registry has it now; `in_flight`: requests on each.
    `linger`: a backend whose endpoint is gone is drained with migrate first, and removed
    once idle (DNS) rather than at once (Kubernetes, whose endpoint goes after the pod)."""
    not_ready, terminating, gone = reasons(source)
    out: list[Action] = []
    mine: dict[str, BackendStatus] = {s.backend.id: s for s in fleet if s.source == source}
    for bid, s in mine.items():
        w = wanted.get(bid)
        draining = s.health.state is HealthState.DRAINING
        if w is None:
            if not linger or (s.migrating and in_flight.get(BackendId(bid), 0) == 0):
                out.append(Remove(bid))
            elif not s.migrating:
                out.append(Drain(bid, True, gone))
        elif w.backend is not None and w.backend != s.backend:
            out.append(Remove(bid))  # the engine behind the id changed: as new
            if w.phase is Phase.READY:
                out.append(Add(w.backend))
        elif w.phase is Phase.TERMINATING:
            if not s.migrating:
                out.append(Drain(bid, True, terminating))
        elif w.phase is Phase.NOT_READY:
            if not draining:
                out.append(Drain(bid, False, not_ready))
        elif draining and s.health.reason in (not_ready, gone):
            out.append(Undrain(bid))  # ready again (an operator's drain is left alone)
    others: dict[str, str] = {s.backend.id: s.source for s in fleet if s.source != source}
    for eid, w in sorted(wanted.items()):
        if eid in mine or w.backend is None or not (w.phase is Phase.READY or w.was_ready):
            continue  # a new endpoint joins only ready, and with its model known
        if eid in others:
            out.append(Refuse(eid, others[eid]))
            continue
        out.append(Add(w.backend))
        if w.phase is not Phase.READY:  # one a leader before this one had: as it is now
            terminates = w.phase is Phase.TERMINATING
            out.append(Drain(eid, terminates, terminating if terminates else not_ready))
    return out
