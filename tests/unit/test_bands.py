"""control/routing/bands.py: priority bands, and fair share by weight inside a band."""

from __future__ import annotations

from collections import Counter
from itertools import count

from control.routing.bands import Bands, Waiting

_ids = count()


def w(tenant: str, band: int = 1, weight: int = 1, cost: int = 100, since: float = 0.0,
      deadline: float = 1e9) -> Waiting[None]:  # fmt: skip
    return Waiting(f"r{next(_ids)}", tenant, band, weight, cost, since, deadline, None)


def test_a_band_is_served_only_while_every_higher_one_is_empty() -> None:
    q: Bands[None] = Bands()
    q.push(batch := w("b", band=2))
    q.push(standard := w("s", band=1))
    q.push(interactive := w("i", band=0))
    assert [q.pop(), q.pop(), q.pop(), q.pop()] == [interactive, standard, batch, None]


def test_the_room_kept_for_higher_bands_is_never_taken_by_a_lower_one() -> None:
    q: Bands[None] = Bands()
    q.push(standard := w("s", band=1))
    q.push(w("b", band=2))
    assert q.pop(lambda band: band < 1) is None  # standard may not go: batch does not pass it
    assert q.pop(lambda band: band <= 1) is standard


def test_weights_share_tokens_three_to_one_whatever_the_request_sizes() -> None:
    q: Bands[None] = Bands()
    for _ in range(400):
        q.push(w("heavy", weight=3, cost=100))
        q.push(w("light", weight=1, cost=37))
    served: Counter[str] = Counter()
    for _ in range(300):
        got = q.pop()
        assert got is not None
        served[got.tenant] += got.cost
    assert abs(served["heavy"] / served["light"] - 3.0) < 0.3, served


def test_a_request_taken_out_is_never_served_and_expired_ones_come_out() -> None:
    q: Bands[None] = Bands()
    gone = w("a")
    q.push(gone)
    q.push(late := w("a", deadline=5.0))
    q.push(kept := w("b"))
    assert q.remove(gone.request_id) is gone and gone.request_id not in q
    assert q.expired(6.0) == [late]
    assert q.pop() is kept and len(q) == 0


def test_the_lowest_bands_newest_request_is_shed_first() -> None:
    q: Bands[None] = Bands()
    q.push(w("i", band=0, since=9.0))
    q.push(w("b", band=2, since=1.0))
    q.push(newest := w("b", band=2, since=2.0))
    assert q.lowest_newest() is newest
