"""The shim's Prometheus metrics (GET /metrics), on a registry owned by one app."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

M = TypeVar("M", Counter, Histogram)  # a labelled metric; its children are of its type

LATENCY_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROUTE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.25)


@dataclass(frozen=True, slots=True)
class LinkStats:
    """The shim's link to control, read at scrape time (ControlLink owns the counts)."""

    degraded: bool = False  # control unreachable: routing from the last snapshot
    outages: int = 0
    degraded_routes: int = 0
    buffered_outcomes: int = 0
    dropped_outcomes: int = 0
    buffered_reports: int = 0
    dropped_reports: Mapping[str, int] = field(default_factory=dict)  # by kind
    rejected_reports: int = 0
    route_socket: bool = False  # routes ride control's route socket (False: gRPC, or none yet)
    tenant_share: int = 1  # enforcing 1/N of each tenant's limits (N > 1 while control is away)


class LinkCollector:
    """Exports LinkStats; a collector, not Counters, because the counts live in ControlLink."""

    def __init__(self, stats: Callable[[], LinkStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "baton_shim_degraded",
            "1 while control is unreachable and routes come from the last snapshot.",
            value=float(s.degraded),
        )
        yield GaugeMetricFamily(
            "baton_shim_route_socket",
            "1 while routes and outcomes ride control's route socket; 0 on gRPC's RouteStream "
            "(control has none, or it can't be reached from here: see the shim's log).",
            value=float(s.route_socket),
        )
        yield GaugeMetricFamily(
            "baton_shim_tenant_share",
            "N while this shim enforces 1/N of every tenant's limits alone (control unreachable, "
            "N the shims it last counted); 1 while control enforces them whole.",
            value=s.tenant_share,
        )
        yield CounterMetricFamily(
            "baton_shim_control_outages", "Times control became unreachable.", value=s.outages
        )
        yield CounterMetricFamily(
            "baton_shim_degraded_routes",
            "Routes and failovers decided by the shim from the last snapshot.",
            value=s.degraded_routes,
        )
        yield GaugeMetricFamily(
            "baton_shim_buffered_outcomes",
            "Outcome reports waiting for control.",
            value=s.buffered_outcomes,
        )
        yield CounterMetricFamily(
            "baton_shim_dropped_outcomes",
            "Outcome reports dropped: the buffer was full while control was unreachable.",
            value=s.dropped_outcomes,
        )
        yield GaugeMetricFamily(
            "baton_shim_buffered_reports",
            "Attempt-failure and failover reports waiting for control.",
            value=s.buffered_reports,
        )
        dropped = CounterMetricFamily(
            "baton_shim_dropped_reports",
            "Attempt-failure and failover reports dropped: the buffer was full.",
            labels=["kind"],
        )
        for kind in ("attempt_failure", "failover"):
            dropped.add_metric([kind], s.dropped_reports.get(kind, 0))
        yield dropped
        yield CounterMetricFamily(
            "baton_shim_rejected_reports",
            "Reports control answered with a permanent error (not retried).",
            value=s.rejected_reports,
        )


class ShimMetrics:
    def __init__(self, link: Callable[[], LinkStats] = LinkStats) -> None:
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
        self.client_write_timeouts = Counter(
            "baton_shim_client_write_timeouts",
            "Streams ended because their client read nothing for --client-write-timeout "
            "seconds (a stalled client holds the engine's KV blocks until its request ends).",
            registry=r,
        )
        self.in_flight = Gauge(
            "baton_shim_requests_in_flight", "Requests being served now.", registry=r
        )
        # A failover is counted (and reported to control) once its seam verdict is known:
        # the side check runs after the resumed stream ends, so a client can have its whole
        # answer before the failover shows in baton_shim_failovers_total.
        self.seam_checks = Gauge(
            "baton_shim_seam_checks_pending",
            "Failovers whose seam is still being checked (not yet counted or reported).",
            registry=r,
        )
        self.spec_rounds = Histogram(
            "baton_shim_spec_round_seconds",
            "Speculative rounds' time by part: waiting for the draft's proposal (draft), for "
            "the target's verification (verify), for the target's detokenize (detokenize), "
            "and the rest, the shim's own work (shim).",
            ["part"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.spec_proposals = Counter(
            "baton_shim_spec_proposals",
            "Speculative rounds by where their proposal came from: drafted while the last "
            "round verified (ahead), or asked for once it was judged (fresh).",
            ["source"],
            registry=r,
        )
        self.spec_drafted = Counter(
            "baton_shim_spec_drafted_tokens",
            "Tokens the drafts proposed in speculative rounds (over rounds: the mean k).",
            registry=r,
        )
        r.register(LinkCollector(link))
        # Label children resolved once: labels() takes a lock and builds a key per call,
        # a measurable share of a request's CPU in the shim.
        self._children: dict[tuple[object, ...], Any] = {}

    def spec_round(self, draft_s: float, verify_s: float, detokenize_s: float, total_s: float,
                   *, ahead: bool, drafted: int) -> None:  # fmt: skip
        """One speculative round: its parts, and the shim's own work as the rest of it."""
        shim_s = max(0.0, total_s - draft_s - verify_s - detokenize_s)
        for part, s in (("draft", draft_s), ("verify", verify_s),
                        ("detokenize", detokenize_s), ("shim", shim_s)):  # fmt: skip
            self._child(self.spec_rounds, part).observe(s)
        self.count(self.spec_proposals, "ahead" if ahead else "fresh")
        self.spec_drafted.inc(drafted)

    def _child(self, metric: M, *labels: str) -> M:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return cast(M, child)

    def count(self, metric: Counter, *labels: str) -> None:
        self._child(metric, *labels).inc()
