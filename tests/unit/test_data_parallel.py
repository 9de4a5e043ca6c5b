"""One rank of a data-parallel vLLM as a backend: what every call to it carries, and which
backends would claim one rank twice."""

from __future__ import annotations

import pytest

from baton.model import DATA_PARALLEL_RANK_HEADER, Backend, BackendId
from clients import render
from clients.client import BackendRow
from control.exceptions import BackendExists
from control.fleet.registry import Registry

URL = "http://10.0.0.7:8000"


def rank(bid: str, r: int | None, url: str = URL) -> Backend:
    return Backend(BackendId(bid), url, "m", data_parallel_rank=r)


def test_every_call_to_a_rank_names_it_beside_the_backends_own_key() -> None:
    keyed = Backend(BackendId("r1"), URL, "m", api_key_env="DP_KEY", data_parallel_rank=1)
    assert keyed.call_headers({"DP_KEY": "k"}) == {
        "Authorization": "Bearer k", DATA_PARALLEL_RANK_HEADER: "1"}
    assert rank("r0", 0).call_headers({}) == {DATA_PARALLEL_RANK_HEADER: "0"}  # 0 is a rank
    assert rank("whole", None).call_headers({}) == {}  # the engine picks its rank itself


@pytest.mark.parametrize(
    ("a", "b", "clash"),
    [
        (rank("a", 0), rank("b", 1), False),  # two ranks of one engine
        (rank("a", 0), rank("b", 0), True),  # one rank twice
        (rank("a", 0), rank("b", None), True),  # the whole engine beside one of its ranks
        (rank("a", None), rank("b", None), False),  # one engine twice: it balances itself
        (rank("a", 0), rank("b", 0, "http://10.0.0.8:8000"), False),  # other engines
    ],
)
def test_two_backends_clash_when_they_would_be_one_rank(
    a: Backend, b: Backend, clash: bool
) -> None:
    assert a.clashes_with(b) is clash and b.clashes_with(a) is clash


def test_a_rank_added_at_run_time_twice_is_refused_and_the_fleet_is_unchanged() -> None:
    reg = Registry([rank("r0", 0)], clock=lambda: 0.0)
    reg.add(rank("r1", 1))
    with pytest.raises(BackendExists, match="'r1' already serves .* data_parallel_rank"):
        reg.add(rank("again", 1))
    assert [s.backend.id for s in reg.snapshot.backends] == ["r0", "r1"]


def test_the_rank_column_shows_only_when_some_backend_is_a_rank() -> None:
    plain = BackendRow("s0", "http://h:1", "m", "vllm", "serve", "healthy", "", "t", 0)
    assert "RANK" not in render.backends([plain])
    r1 = BackendRow("s1", "http://h:2", "m", "vllm", "serve", "healthy", "", "t", 0,
                    data_parallel_rank=1)  # fmt: skip
    head, one, two = render.backends([plain, r1]).splitlines()
    assert head.split()[-2:] == ["RANK", "URL"]
    assert two.split()[-2:] == ["1", "http://h:2"]
    assert one.split()[-2:] == ["-", "http://h:1"]
