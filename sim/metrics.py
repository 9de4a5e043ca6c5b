"""Prometheus metrics under vLLM's names, on a registry owned by one app.

A per-app CollectorRegistry (not the global one) lets tests and the embedded
fleet run several sims in one process. Each family is registered once; each
data-parallel rank gets its own label children (EngineMetrics).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sim.specdecode import SpecCounts

# vLLM's own bucket edges, so dashboards built for vLLM read the sim the same way.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
FINISHED_REASONS = ("stop", "length", "abort", "error")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SimMetrics:
    """The registry, each family once, and one EngineMetrics per data-parallel rank.

    vLLM's API server exports every per-engine series once per engine core, told apart
    by the ``engine`` label (``engine="0"``, ``engine="1"``, ...): one page, one
    HELP/TYPE per family, samples for all ranks."""

    def __init__(
        self,
        model_name: str,
        *,
        spec_positions: int = 0,
        block_size: int = 16,
        cache_blocks: int = 4096,
        engines: int = 1,
        max_loras: int | None = None,
    ) -> None:
        self.registry = r = CollectorRegistry()
        # With --enable-lora (max_loras set): the LoRA families (sim.lora_runtime feeds them).
        self.lora = LoraMetrics(r, max_loras) if max_loras is not None else None
        labels = ("model_name", "engine")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, (*labels, *extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        fam = _Families(
            running=gauge("vllm:num_requests_running", "Requests in model execution batches."),
            waiting=gauge("vllm:num_requests_waiting", "Requests waiting to be processed."),
            kv_usage=gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent."),
            prompt_tokens=counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
            generation_tokens=counter(
                "vllm:generation_tokens", "Number of generation tokens processed."
            ),
            cache_queries=counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
            ),
            cache_hits=counter(
                "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
            ),
            success=counter(
                "vllm:request_success", "Count of successfully processed requests.",
                "finished_reason",
            ),  # fmt: skip
            ttft=histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                _TTFT_BUCKETS,
            ),
            e2e=histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                _E2E_BUCKETS,
            ),
            spec=_SpecFamilies(r, labels) if spec_positions > 0 else None,
        )
        # vLLM publishes its cache config as an info-style gauge fixed at 1, per engine;
        # routers read block_size from it (KV block size must match across a spec pair).
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"),
            registry=r,
        )
        self.engines: tuple[EngineMetrics, ...] = tuple(
            EngineMetrics(fam, (model_name, str(rank)), spec_positions)
            for rank in range(max(1, engines))
        )
        for rank in range(len(self.engines)):
            info = (str(block_size), str(cache_blocks > 0), str(cache_blocks), str(rank))
            cache_info.labels(*info).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoraMetrics:
    """vLLM's vllm:lora_requests_info, and the sim's own count of adapter loads.

    The gauge is the API server's (no engine label). Each label set it was ever set with
    stays on the page, valued the time it was last current (vLLM's set_to_current_time),
    so a reader takes the sample with the largest value. ``sim:lora_loads_total`` is not
    vLLM's: adapter weights loaded into an engine rank, a reload after an eviction too."""

    def __init__(self, r: CollectorRegistry, max_loras: int) -> None:
        self._max = str(max_loras)
        self._info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), registry=r,
        )  # fmt: skip
        self.loads = Counter(
            "sim:lora_loads", "Sim only: LoRA adapter loads into an engine rank.",
            ("adapter", "engine"), registry=r,
        )  # fmt: skip

    def current(self, waiting: str, running: str) -> None:
        self._info.labels(self._max, waiting, running).set_to_current_time()


class _SpecFamilies:
    """Only a sim configured as a speculative target exports these (like vLLM)."""

    def __init__(self, r: CollectorRegistry, labels: tuple[str, ...]) -> None:
        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, (*labels, *extra), registry=r)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            "position",
        )


@dataclass(frozen=True, slots=True)
class _Families:
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    prompt_tokens: Counter
    generation_tokens: Counter
    cache_queries: Counter
    cache_hits: Counter
    success: Counter
    ttft: Histogram
    e2e: Histogram
    spec: _SpecFamilies | None


class EngineMetrics:
    """One engine's label children, resolved once so the request path only calls
    ``inc``/``set``/``observe``."""

    def __init__(self, fam: _Families, values: tuple[str, str], spec_positions: int) -> None:
        self.running = fam.running.labels(*values)
        self.waiting = fam.waiting.labels(*values)
        self.kv_usage = fam.kv_usage.labels(*values)
        self.prompt_tokens = fam.prompt_tokens.labels(*values)
        self.generation_tokens = fam.generation_tokens.labels(*values)
        self.cache_queries = fam.cache_queries.labels(*values)
        self.cache_hits = fam.cache_hits.labels(*values)
        self.success = {reason: fam.success.labels(*values, reason) for reason in FINISHED_REASONS}
        self.ttft = fam.ttft.labels(*values)
        self.e2e = fam.e2e.labels(*values)
        self.spec: SpecMetrics | None = None
        if fam.spec is not None:
            self.spec = SpecMetrics(fam.spec, values, spec_positions)


class SpecMetrics:
    def __init__(self, fam: _SpecFamilies, values: tuple[str, str], positions: int) -> None:
        self.drafts = fam.drafts.labels(*values)
        self.draft_tokens = fam.draft_tokens.labels(*values)
        self.accepted = fam.accepted.labels(*values)
        self.per_pos = [fam.per_pos.labels(*values, str(i)) for i in range(positions)]

    def add(self, counts: SpecCounts) -> None:
        self.drafts.inc(counts.drafts)
        self.draft_tokens.inc(counts.draft_tokens)
        self.accepted.inc(counts.accepted_tokens)
        for child, n in zip(self.per_pos, counts.accepted_per_pos, strict=True):
            child.inc(n)
