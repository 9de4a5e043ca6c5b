"""Prometheus metrics under vLLM's names, on a registry owned by one app.

A per-app CollectorRegistry (not the global one) lets tests and the embedded
fleet run several sims in one process. Label children are resolved once here
so the request path only calls ``inc``/``set``/``observe``.
"""

from __future__ import annotations

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
    def __init__(
        self,
        model_name: str,
        *,
        spec_positions: int = 0,
        block_size: int = 16,
        cache_blocks: int = 4096,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name", "engine")
        values = (model_name, "0")
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=r,
        )
        self.success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(*values)

        # vLLM publishes its cache config as an info-style gauge fixed at 1; routers
        # read block_size from it (KV block size must match across a spec pair).
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"),
            registry=r,
        ).labels(str(block_size), str(cache_blocks > 0), str(cache_blocks), "0").set(1)

        # Only a sim configured as a speculative target exports these (like vLLM).
        self.spec: SpecMetrics | None = None
        if spec_positions > 0:
            self.spec = SpecMetrics(r, labels, values, spec_positions)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpecMetrics:
    def __init__(
        self, r: CollectorRegistry, labels: tuple[str, ...], values: tuple[str, ...], positions: int
    ) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(*values)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            (*labels, "position"),
            registry=r,
        )
        self.per_pos = [per_pos.labels(*values, str(i)) for i in range(positions)]

    def add(self, counts: SpecCounts) -> None:
        self.drafts.inc(counts.drafts)
        self.draft_tokens.inc(counts.draft_tokens)
        self.accepted.inc(counts.accepted_tokens)
        for child, n in zip(self.per_pos, counts.accepted_per_pos, strict=True):
            child.inc(n)
