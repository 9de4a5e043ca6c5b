"""The sim's data-parallel pieces, as vLLM 0.32 has them: each rank's KV-event endpoints
(KVEventPublisher.offset_endpoint_port), the X-data-parallel-rank header, the internal
load balancer's pick, the --data-parallel-size flag and one /metrics page for all ranks."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim.balancer import LeastLoaded, header_rank
from sim.kv_wire import KvEventsConfig, offset_endpoint_port
from sim.metrics import SimMetrics
from sim.protocol import ApiError
from tests.factories import sim_config


# -- each rank's endpoints ------------------------------------------------------------
@pytest.mark.parametrize(
    ("endpoint", "rank", "moved"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 1, "tcp://*:5558"),
        ("tcp://127.0.0.1:5557", 3, "tcp://127.0.0.1:5560"),
        ("tcp://[::1]:6000", 2, "tcp://[::1]:6002"),
        ("tcp://*:0", 1, "tcp://*:0"),  # the OS picks each rank's port
        ("inproc://cache", 2, "inproc://cache_dp2"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),  # rank 0 keeps whatever it was given
        ("", 1, ""),
    ],
)
def test_each_rank_moves_the_endpoint_as_vllm_does(endpoint: str, rank: int, moved: str) -> None:
    assert offset_endpoint_port(endpoint, rank) == moved


def test_an_ipc_endpoint_cannot_be_shared_past_rank_0() -> None:
    with pytest.raises(ValueError, match="rank 1"):
        offset_endpoint_port("ipc:///tmp/kv", 1)


def test_a_config_moves_both_endpoints_for_its_rank() -> None:
    kv = KvEventsConfig(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600", topic="t")
    one = kv.for_rank(1)
    assert (one.endpoint, one.replay_endpoint, one.topic) == ("tcp://*:5558", "tcp://*:5601", "t")
    assert kv.for_rank(0) is kv
    assert KvEventsConfig(endpoint="tcp://*:5557").for_rank(2).replay_endpoint is None


# -- the rank of a request ------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "rank"),
    [("1", 1), (" 0 ", 0), ("-1", -1), ("7", 7), ("one", None), ("1.0", None), ("", None),
     (None, None)],
)  # fmt: skip
def test_the_header_is_an_integer_or_ignored(value: str | None, rank: int | None) -> None:
    assert header_rank(value) == rank


def test_a_pinned_rank_is_served_by_that_rank_whatever_the_load() -> None:
    lb = LeastLoaded(2)
    assert lb.pick([0, 5], pinned=1) == 1
    assert lb.pick([5, 0], pinned=0) == 0


@pytest.mark.parametrize("pinned", [2, -1, 10])
def test_a_rank_out_of_range_is_a_400(pinned: int) -> None:
    with pytest.raises(ApiError) as err:
        LeastLoaded(2).pick([0, 0], pinned=pinned)
    assert err.value.status == 400
    assert err.value.body()["error"]["message"] == (
        f"data_parallel_rank {pinned} is out of range [0, 2)."
    )


def test_one_engine_still_checks_the_range_as_vllm_does() -> None:
    lb = LeastLoaded(1)
    assert lb.pick([3], pinned=0) == 0 and lb.pick([3]) == 0
    with pytest.raises(ApiError):
        lb.pick([0], pinned=1)


def test_without_a_header_the_least_loaded_rank_serves() -> None:
    lb = LeastLoaded(3)
    assert lb.pick([2, 0, 1]) == 1
    assert lb.pick([2, 3, 1]) == 2
    assert lb.pick([0, 3, 1]) == 0


def test_ties_go_round_robin_as_vllms_rotating_scan() -> None:
    """vLLM starts each scan one engine further on: idle engines take turns, and a busy
    one is passed over without breaking the turn."""
    lb = LeastLoaded(2)
    assert [lb.pick([0, 0]) for _ in range(4)] == [0, 1, 0, 1]
    assert lb.pick([1, 0]) == 1  # its turn was rank 0's, but rank 0 is busy
    assert lb.pick([1, 0]) == 1
    lb = LeastLoaded(2)
    assert lb.pick([0, 0], pinned=1) == 1
    assert lb.pick([0, 0]) == 0  # a pinned pick leaves the turn where it was


# -- the flag ---------------------------------------------------------------------------
def test_one_rank_by_default_and_the_flag_reaches_the_config() -> None:
    assert sim_config().data_parallel_size == 1
    assert sim_config("--data-parallel-size", "4").data_parallel_size == 4


def test_a_size_below_1_is_refused() -> None:
    with pytest.raises(SystemExit, match="--data-parallel-size"):
        sim_config("--data-parallel-size", "0")


def test_an_ipc_endpoint_refuses_to_start_with_several_ranks() -> None:
    assert sim_config("--kv-events-endpoint", "ipc:///tmp/sim-kv").kv_events is not None
    with pytest.raises(SystemExit, match="cannot be moved for data-parallel rank 1"):
        sim_config("--kv-events-endpoint", "ipc:///tmp/sim-kv", "--data-parallel-size", "2")
    with pytest.raises(SystemExit, match="ipc"):  # the replay socket needs moving too
        sim_config("--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint",
                   "ipc:///tmp/sim-replay", "--data-parallel-size", "2")  # fmt: skip


# -- one /metrics page ------------------------------------------------------------------
def test_every_family_once_with_samples_for_every_rank() -> None:
    m = SimMetrics("tiny", engines=2, spec_positions=2, block_size=32, cache_blocks=100)
    m.engines[1].cache_hits.inc(7)
    text = m.render().decode()
    helps = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP ")]
    assert len(helps) == len(set(helps))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits",
                 "vllm:time_to_first_token_seconds", "vllm:spec_decode_num_drafts",
                 "vllm:cache_config_info"):  # fmt: skip
        engines = {s.labels["engine"] for s in families[name].samples}
        assert engines == {"0", "1"}, name
    hits = {
        s.labels["engine"]: s.value
        for s in families["vllm:prefix_cache_hits"].samples
        if s.name.endswith("_total")
    }
    assert hits == {"0": 0.0, "1": 7.0}
    info = [s.labels for s in families["vllm:cache_config_info"].samples]
    assert all(i["block_size"] == "32" and i["num_gpu_blocks"] == "100" for i in info)
