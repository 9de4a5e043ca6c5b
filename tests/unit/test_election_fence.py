"""The fence on a leading replica (control/replicas/election.py): it leads while its lease
holds by its own clock; past that, only while etcd answers nobody, and only if etcd stopped
answering while the lease still held. A leader woken from a stop past its lease does not
lead, whatever etcd then says."""

from __future__ import annotations

from typing import Any

from control.replicas.election import Election, Member


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _noop(term: int) -> None:
    return None


def leader(clock: Clock) -> Election:
    etcd: Any = None  # the fence reads no etcd
    e = Election(etcd, b"/l", b"/r/", Member("c0", "a:1"), 1, on_lead=_noop, clock=clock)
    e.term, e.ttl = 7, 1.0
    e._valid_until, e._ok_at = clock.now + 1.0, clock.now  # a keep-alive answered just now
    return e


def test_a_leader_leads_while_its_lease_holds_by_its_own_clock() -> None:
    clock = Clock()
    e = leader(clock)
    clock.now += 0.9
    assert e.leading
    clock.now += 0.2
    assert not e.leading  # the lease ran out, and nothing says etcd is away


def test_etcd_down_while_the_lease_held_keeps_the_leader_routing() -> None:
    clock = Clock()
    e = leader(clock)
    clock.now += 0.25
    e._failed("etcd did not answer")
    for _ in range(8):  # keep-alives failing every quarter second, long past the lease
        clock.now += 0.25
        e._failed("etcd did not answer")
        assert e.leading
    clock.now += 1.5  # no keep-alive tried for longer than the lease: not trusted
    assert not e.leading


def test_a_leader_woken_past_its_lease_does_not_lead_even_if_etcd_fails_it() -> None:
    clock = Clock()
    e = leader(clock)
    clock.now += 30.0  # SIGSTOPped for 30 s
    assert not e.leading
    e._failed("etcd did not answer")  # the first keep-alive after the stop fails
    assert not e.leading
