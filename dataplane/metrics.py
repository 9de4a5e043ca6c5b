"""The shim's Prometheus metrics (GET /metrics), on a registry owned by one app."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROUTE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25)


class ShimMetrics:
    def __init__(self, dropped_outcomes: Callable[[], float] = lambda: 0.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "baton_shim_requests", "Client requests answered.", ["endpoint", "status"], registry=r
        )
        self.attempts = Counter(
            "baton_shim_attempts",
            "Upstream attempts by backend and result.",
            ["backend", "result"],
            registry=r,
        )
        self.failovers = Counter(
            "baton_shim_failovers",
            "Mid-stream failovers.",
            ["failure", "seam", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "baton_shim_ttft_seconds",
            "Client request to first byte sent.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.route = Histogram(
            "baton_shim_route_seconds",
            "Asking control where to go.",
            buckets=ROUTE_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "baton_shim_requests_in_flight", "Requests being served now.", registry=r
        )
        dropped = Gauge(
            "baton_shim_dropped_outcomes",
            "Outcome reports dropped because control was unreachable too long.",
            registry=r,
        )
        dropped.set_function(dropped_outcomes)
        # Label children resolved once: labels() takes a lock and builds a key per call,
        # a measurable share of a request's CPU in the shim.
        self._children: dict[tuple[object, ...], Counter] = {}

    def count(self, metric: Counter, *labels: str) -> None:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        child.inc()
