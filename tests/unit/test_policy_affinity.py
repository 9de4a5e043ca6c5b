"""The adaptive and affinity policies, table-driven over hand-made snapshots and pins."""

from __future__ import annotations

import pytest

from baton.model import (
    BackendId,
    Decision,
    HealthState,
    Reason,
    RequestShape,
    RouteRequest,
    Snapshot,
)
from baton.spread import Spreader
from control.fleet.pins import Pin, PinMatch, PinTable
from control.routing.policy import RoutingView, look_up, make_policy
from control.routing.policy.adaptive import SpillGuard
from tests.factories import status

H = HealthState


def snap(*states: tuple[str, HealthState]) -> Snapshot:
    return Snapshot(1, tuple(status(b, s) for b, s in states))


FLEET = snap(("a", H.HEALTHY), ("b", H.HEALTHY), ("c", H.HEALTHY))
CHAIN = (b"h1", b"h2", b"h3")


def req(turns: tuple[bool, ...] = (False, True, False)) -> RouteRequest:
    return RouteRequest(
        "r",
        RequestShape(
            model="m",
            message_count=len(turns),
            prefix_chain=CHAIN[: len(turns)],
            assistant_turns=turns,
        ),
    )


def match(backend: str, index: int) -> PinMatch:
    return PinMatch(Pin(CHAIN[index], BackendId(backend), index + 1, 0.0, 0.0), index)


def view(
    request: RouteRequest,
    fleet: Snapshot,
    load: dict[BackendId, int] | None = None,
    pin: PinMatch | None = None,
    spread: Spreader | None = None,
) -> RoutingView:
    """What the router's lookup hands the policy (a routable fleet here)."""
    found = look_up(request, fleet, load or {}, spread or Spreader(), pin)
    assert isinstance(found, RoutingView)
    return found


def decide(policy: str, request: RouteRequest, view: RoutingView) -> Decision:
    return make_policy(policy).decide(request, view)


@pytest.mark.parametrize(
    ("policy", "turns", "pin", "fleet", "load", "reason", "primary"),
    [
        # A continuation (matched prefix holds an assistant turn) follows its pin.
        ("adaptive", (False, True, False), match("c", 1), FLEET, {}, Reason.PIN_HIT, "c"),
        # A matched prefix without an assistant turn (shared system prompt) spreads.
        ("adaptive", (False, True, False), match("c", 0), FLEET, {}, Reason.SPREAD, "a"),
        ("adaptive", (False,), None, FLEET, {}, Reason.SPREAD, "a"),
        # The pinned backend is gone (drained / dead / removed): re-pinned, not an error.
        (
            "adaptive",
            (False, True, False),
            match("c", 1),
            snap(("a", H.HEALTHY), ("b", H.HEALTHY), ("c", H.DRAINING)),
            {},
            Reason.REPIN,
            "a",
        ),
        (
            "adaptive",
            (False, True, False),
            match("c", 1),
            snap(("a", H.HEALTHY), ("b", H.HEALTHY), ("c", H.DEMOTED)),
            {},
            Reason.REPIN,
            "a",
        ),
        ("adaptive", (False, True, False), match("zz", 1), FLEET, {}, Reason.REPIN, "a"),
        # Overloaded pinned backend: spill to the least loaded other one.
        (
            "adaptive",
            (False, True, False),
            match("c", 1),
            FLEET,
            {"a": 3, "b": 1, "c": 12},
            Reason.SPILL,
            "b",
        ),
        # Busy but within the guard (others' mean 3, 2x3+2 = 8 >= 8): stay warm.
        (
            "adaptive",
            (False, True, False),
            match("c", 1),
            FLEET,
            {"a": 4, "b": 2, "c": 8},
            Reason.PIN_HIT,
            "c",
        ),
        # Affinity follows any pin, even a shared system prompt's.
        ("affinity", (False, True, False), match("c", 0), FLEET, {}, Reason.PIN_HIT, "c"),
        ("affinity", (False,), None, FLEET, {}, Reason.SPREAD, "a"),
        (
            "affinity",
            (False, True),
            match("c", 1),
            snap(("a", H.HEALTHY), ("c", H.DOWN)),
            {},
            Reason.REPIN,
            "a",
        ),
        # Round robin ignores pins.
        ("roundrobin", (False, True, False), match("c", 1), FLEET, {}, Reason.SPREAD, "a"),
    ],
)
def test_decisions(
    policy: str,
    turns: tuple[bool, ...],
    pin: PinMatch | None,
    fleet: Snapshot,
    load: dict[str, int],
    reason: Reason,
    primary: str,
) -> None:
    request = req(turns)
    d = decide(
        policy, request, view(request, fleet, {BackendId(k): v for k, v in load.items()}, pin)
    )
    assert (d.reason, d.backends[0].id) == (reason, primary)
    routable = {b.backend.id for b in fleet.backends if b.routable}
    assert {b.id for b in d.backends} == routable  # every routable backend is a fallback
    assert len(d.backends) == len(set(d.backends))


def test_same_prefix_burst_spreads_evenly_under_adaptive() -> None:
    policy, spread = make_policy("adaptive"), Spreader()
    pins = PinTable()
    counts: dict[str, int] = {}
    for i in range(12):
        request = RouteRequest(
            f"r{i}",
            RequestShape(
                model="m",
                message_count=2,
                prefix_chain=(b"sys", b"user%d" % i),
                assistant_turns=(False, False),
            ),
        )
        pin = pins.longest(request.shape.prefix_chain, 0.0)
        d = policy.decide(request, view(request, FLEET, pin=pin, spread=spread))
        pins.pin_chain(request.shape.prefix_chain, d.backends[0].id, 0.0)
        counts[d.backends[0].id] = counts.get(d.backends[0].id, 0) + 1
    assert counts == {"a": 4, "b": 4, "c": 4}


def test_affinity_piles_a_same_prefix_burst_onto_one_card() -> None:
    policy, spread = make_policy("affinity"), Spreader()
    pins = PinTable()
    chosen = set()
    for i in range(6):
        chain = (b"sys", b"user%d" % i)
        request = RouteRequest(
            f"r{i}", RequestShape(model="m", message_count=2, prefix_chain=chain)
        )
        d = policy.decide(
            request, view(request, FLEET, pin=pins.longest(chain, 0.0), spread=spread)
        )
        pins.pin_chain(chain, d.backends[0].id, 0.0)
        chosen.add(d.backends[0].id)
    assert chosen == {"a"}


def test_spill_guard_compares_with_the_other_backends() -> None:
    g = SpillGuard(factor=2.0, slack=2)
    assert not g.overloaded(0, [0])
    assert not g.overloaded(2, [0])  # idle fleet: a couple of warm turns stay put
    assert g.overloaded(3, [0])  # 3 > 2 x 0 + 2
    assert not g.overloaded(10, [4, 4])  # 10 = 2 x 4 + 2
    assert g.overloaded(11, [4, 4])
    assert not g.overloaded(50, [])  # nowhere to spill to


def test_pin_table_longest_lru_ttl() -> None:
    t = PinTable(capacity=3, ttl=10.0)
    t.pin_chain((b"a", b"b"), BackendId("x"), now=0.0)
    t.pin(b"c", BackendId("y"), 3, now=1.0)
    m = t.longest((b"a", b"b", b"c", b"d"), now=2.0)
    assert m is not None and (m.index, m.pin.backend_id) == (2, "y")
    t.touch(m, now=3.0)
    t.pin(b"d", BackendId("z"), 4, now=4.0)  # capacity 3: the least recently used goes
    assert t.longest((b"a",), now=4.0) is None
    assert t.longest((b"a", b"b"), now=4.0) is not None
    assert t.longest((b"a", b"b"), now=20.0) is None  # expired by TTL
    assert t.drop_backend("y") == 1 and len(t) == 1
    assert t.clear() == 1 and len(t) == 0


def test_prefer_moves_the_first_fit_preferred_backend_to_the_front() -> None:
    from baton.spread import prefer

    d = decide("roundrobin", req(), view(req(), FLEET))  # a, b, c
    assert [b.id for b in prefer(d, ["zz", "c", "b"]).backends] == ["c", "a", "b"]
    assert prefer(d, []) is d
    assert prefer(d, ["gone"]) is d
