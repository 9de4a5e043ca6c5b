"""Every routing policy in POLICIES against one table of fleets (control/routing/policy/base.py
is the contract): a policy is pure and synchronous, and never raises for "no capacity": it
answers a refusal instead. What a client would notice is asserted: which backends a decision
may send the request to (only healthy ones of its model, never an excluded one, each at most
once, every healthy one listed so a failure can resume on any of them), or the refusal it
gets when there is none. Panic routing over demoted backends is the router's, not a policy's
(tests/unit/test_routing_panic.py)."""

from __future__ import annotations

import inspect
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from baton.model import (
    BackendId,
    BackendStatus,
    Decision,
    HealthState,
    Reason,
    RequestShape,
    Role,
    RouteRequest,
    Snapshot,
)
from baton.spread import Spreader
from control.fleet.pins import Pin, PinMatch
from control.routing.policy import POLICIES, Policy, RoutingView, look_up, make_policy
from control.routing.policy.base import Prediction
from tests.factories import status

H, DEM, DRN, DOWN = (
    HealthState.HEALTHY,
    HealthState.DEMOTED,
    HealthState.DRAINING,
    HealthState.DOWN,
)
CHAIN = (b"system", b"user", b"assistant", b"user again")
# A continuation: its second message is an assistant turn, so a pin on it is followed.
TURNS = (False, False, True, False)
REFUSALS = frozenset({Reason.NO_BACKEND, Reason.UNKNOWN_MODEL})
VERSION = 42


@dataclass(frozen=True)
class Case:
    fleet: tuple[BackendStatus, ...]
    # The backends a decision must list (primary first, then fallbacks); empty: a refusal.
    serves: frozenset[str] = frozenset()
    refusal: Reason | None = None  # the refusal's reason when `serves` is empty
    exclude: tuple[str, ...] = ()  # backends the request already failed on
    pin: str | None = None  # the backend the conversation's prefix is pinned to
    load: Mapping[str, int] = field(default_factory=dict)  # in-flight requests per backend
    cached: Mapping[str, int] = field(default_factory=dict)  # prompt tokens a backend holds


def serving(*ids: str) -> frozenset[str]:
    return frozenset(ids)


CASES: dict[str, Case] = {
    "one backend": Case((status("a"),), serving("a")),
    "equal candidates": Case((status("a"), status("b"), status("c")), serving("a", "b", "c")),
    "empty fleet": Case((), refusal=Reason.UNKNOWN_MODEL),
    "every backend demoted": Case((status("a", DEM), status("b", DEM)), refusal=Reason.NO_BACKEND),
    "every backend out of service": Case(
        (status("a", DEM), status("b", DRN), status("c", DOWN)), refusal=Reason.NO_BACKEND
    ),
    "demoted, draining and down are skipped": Case(
        (status("a", DEM), status("b"), status("c", DRN), status("d", DOWN)), serving("b")
    ),
    "other models and drafts are not candidates": Case(
        (status("x", model="other"), status("a"), status("d", role=Role.DRAFT)), serving("a")
    ),
    "targets serve clients": Case((status("a"), status("t", role=Role.TARGET)), serving("a", "t")),
    "nobody serves the model": Case((status("x", model="other"),), refusal=Reason.UNKNOWN_MODEL),
    "only drafts serve the model": Case(
        (status("d", role=Role.DRAFT),), refusal=Reason.UNKNOWN_MODEL
    ),
    "excluded backends are skipped": Case(
        (status("a"), status("b"), status("c")), serving("c"), exclude=("a", "b")
    ),
    "every backend excluded": Case(
        (status("a"), status("b")), refusal=Reason.NO_BACKEND, exclude=("a", "b")
    ),
    "excluded and the rest down": Case(
        (status("a"), status("b", DOWN)), refusal=Reason.NO_BACKEND, exclude=("a",)
    ),
    "pinned to a healthy backend": Case(
        (status("a"), status("b"), status("c")), serving("a", "b", "c"), pin="b"
    ),
    "pinned to a draining backend": Case(
        (status("a"), status("b", DRN)), serving("a"), pin="b", cached={"b": 900}
    ),
    "pinned to a demoted backend": Case(
        (status("a", DEM), status("b")), serving("b"), pin="a", cached={"a": 900}
    ),
    "pinned to a removed backend": Case((status("a"), status("b")), serving("a", "b"), pin="z"),
    "pinned to an excluded backend": Case(
        (status("a"), status("b")), serving("b"), pin="a", exclude=("a",), cached={"a": 900}
    ),
    "pinned backend overloaded": Case(
        (status("a"), status("b"), status("c")),
        serving("a", "b", "c"),
        pin="b",
        load={"b": 50},
    ),
    "pinned backend has the cache, another the load": Case(
        (status("a"), status("b")),
        serving("a", "b"),
        pin="a",
        load={"a": 9},
        cached={"a": 900},
    ),
}


def request(case: Case) -> RouteRequest:
    shape = RequestShape(
        "m",
        message_count=len(CHAIN),
        prefix_chain=CHAIN,
        assistant_turns=TURNS,
        prompt_chars=4000,
    )
    return RouteRequest("r", shape, frozenset(BackendId(e) for e in case.exclude))


def decide(policy: Policy, case: Case, spread: Spreader | None = None) -> Decision:
    """As the router asks: the lookup (candidates, the refusal, the ring from `spread`, the
    router's counters), then the policy."""
    pin = None
    if case.pin is not None:
        pin = PinMatch(Pin(CHAIN[2], BackendId(case.pin), 3, 0.0, 0.0), 2)
    # What the router builds for a policy that predicts; the others never read it.
    predict = Prediction(
        cached_tokens={BackendId(b): n for b, n in case.cached.items()}, prompt_tokens=1000
    )
    load = {BackendId(b): n for b, n in case.load.items()}
    snapshot = Snapshot(VERSION, case.fleet)
    found = look_up(request(case), snapshot, load, spread or Spreader(), pin, predict)
    return found if isinstance(found, Decision) else policy.decide(request(case), found)


def ids(decision: Decision) -> list[str]:
    return [b.id for b in decision.backends]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_sends_only_where_the_request_can_be_served(name: str, case: Case) -> None:
    policy, spread = make_policy(name), Spreader()
    # Several in a row: the spread counters move between decisions.
    for _ in range(4):
        d = decide(policy, case, spread)
        assert isinstance(d, Decision) and d.snapshot_version == VERSION
        if case.refusal is not None:
            # No capacity is an answer, never an exception: no backend, and why.
            assert d.backends == () and d.reason is case.refusal and d.detail
            continue
        got = ids(d)
        assert len(got) == len(set(got)), f"{name} lists a backend twice: {got}"
        assert set(got) == case.serves, f"{name} sent the request to {got}"
        assert d.reason not in REFUSALS


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_refusal_says_which_backends_could_not_serve(name: str) -> None:
    d = decide(make_policy(name), CASES["every backend out of service"])
    # What an operator reads in the audit log: each backend and its state.
    assert "a=demoted" in d.detail and "b=draining" in d.detail and "c=down" in d.detail
    unknown = decide(make_policy(name), CASES["nobody serves the model"])
    assert "'m'" in unknown.detail


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_equal_candidates_share_a_burst_of_first_turns(name: str) -> None:
    """Ties never pile a burst onto one backend: three fresh conversations on three equal
    backends start on three different ones."""
    policy, spread = make_policy(name), Spreader()
    fleet = Snapshot(VERSION, (status("a"), status("b"), status("c")))
    first_turn = RouteRequest("r", RequestShape("m", message_count=1, prefix_chain=CHAIN[:1]))
    views = [look_up(first_turn, fleet, {}, spread) for _ in range(3)]
    primaries = {
        policy.decide(first_turn, v).backends[0].id for v in views if isinstance(v, RoutingView)
    }
    assert primaries == {"a", "b", "c"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_is_pure_the_same_inputs_give_the_same_decisions(name: str) -> None:
    """No clock, no global randomness, no hidden input: two instances fed the same requests
    decide alike, and the process's random state is left alone."""
    before = random.getstate()
    runs = []
    for _ in range(2):
        policy, spread = make_policy(name), Spreader()
        runs.append([decide(policy, case, spread) for case in CASES.values() for _ in range(2)])
    assert runs[0] == runs[1]
    assert random.getstate() == before


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_is_synchronous_and_named_as_configured(name: str) -> None:
    policy = make_policy(name)
    assert not inspect.iscoroutinefunction(policy.decide)
    assert policy.name == name and isinstance(policy.predicts, bool)


def test_an_unknown_policy_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'nope'") as err:
        make_policy("nope")
    assert all(name in str(err.value) for name in POLICIES)
