"""Control's Prometheus metrics, on a registry owned by one control plane (tests run several
in one process). Fleet-wide values (backends by state, pins, in flight) are read from the
registry when scraped, so the routing path only counts."""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.model import HealthState, Snapshot
from baton.pricing import amount
from baton.tenancy import FILE_TENANT
from control.fleet.registry import Registry
from control.fleet.tenants import TenantBook
from control.pairs.flow import PairFlow
from control.signals.kv.index import KvState

# Route decisions take tens of microseconds; failover gaps a few milliseconds.
ROUTE_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3)


class FleetCollector(Collector):
    def __init__(
        self, registry: Registry, pairs: PairFlow, now: Callable[[], float] = time.time
    ) -> None:
        self._registry = registry
        self._pairs = pairs
        self._now = now  # the clock the readings are stamped with

    def _engine_load(self, snap: Snapshot) -> Iterator[GaugeMetricFamily]:
        """Each engine's own gauges at control's last reading (control/signals/engine_load.py)."""
        fams = {
            "running": GaugeMetricFamily("baton_engine_requests_running",
                                         "The engine's own running requests.", labels=["backend"]),
            "waiting": GaugeMetricFamily("baton_engine_requests_waiting",
                                         "The engine's own waiting requests.", labels=["backend"]),
            "kv": GaugeMetricFamily("baton_engine_kv_cache_usage",
                                    "The engine's KV cache use (0..1).", labels=["backend"]),
            "age": GaugeMetricFamily("baton_engine_reading_age_seconds",
                                     "Age of the last reading of the engine's gauges.",
                                     labels=["backend"]),
        }  # fmt: skip
        now = self._now()
        for b in snap.backends:
            reading = self._registry.engine_load(b.backend.id)
            if reading is None:
                continue
            fams["running"].add_metric([b.backend.id], reading.running)
            fams["waiting"].add_metric([b.backend.id], reading.waiting)
            if reading.kv_usage is not None:
                fams["kv"].add_metric([b.backend.id], reading.kv_usage)
            fams["age"].add_metric([b.backend.id], max(now - reading.read_at, 0.0))
        yield from fams.values()

    def collect(self) -> Iterator[Metric]:
        snap = self._registry.snapshot
        states = Tally(b.health.state for b in snap.backends)
        backends = GaugeMetricFamily(
            "baton_backends", "Registered backends by health state.", labels=["state"]
        )
        for state in HealthState:
            backends.add_metric([state.value], states.get(state, 0))
        yield backends
        pins = GaugeMetricFamily(
            "baton_pins",
            "Pins held: prefix (KV-cache affinity) and response (who stores a response).",
            labels=["kind"],
        )
        pins.add_metric(["prefix"], len(self._registry.placement.pins))
        pins.add_metric(["response"], self._registry.placement.owner_count)
        yield pins
        yield from self._engine_load(snap)
        yield GaugeMetricFamily(
            "baton_requests_in_flight",
            "Requests routed and not yet finished, over all shims.",
            self._registry.in_flight_total(),
        )
        yield GaugeMetricFamily(
            "baton_snapshot_version", "Current fleet snapshot version.", snap.version
        )
        yield GaugeMetricFamily(
            "baton_shims_watching",
            "Shims following this control's snapshots (a replica: those that found it leads).",
            snap.shims,
        )
        pairs = self._pairs
        labels = ["pair", "draft", "target", "params_hash", "state"]
        baseline = GaugeMetricFamily(
            "baton_pair_acceptance_baseline",
            "Paired acceptance baseline (EWMA of accepted/drafted) per draft and params hash.",
            labels=labels,
        )
        recent = GaugeMetricFamily(
            "baton_pair_acceptance",
            "Acceptance on each pair's current pairing (EWMA).",
            labels=labels,
        )
        for p in pairs:
            values = [p.id, p.draft_id, p.target_id, p.params_hash, p.state.value]
            if (b := pairs.baseline(p)) is not None:
                baseline.add_metric(values, b)
            if p.recent is not None:
                recent.add_metric(values, p.recent)
        yield baseline
        yield recent
        yield from self._kv()
        yield from self._adapters(snap)

    def _adapters(self, snap: Snapshot) -> Iterator[Metric]:
        """The LoRA adapters each backend holds as control knows them, and its room."""
        held = GaugeMetricFamily("baton_backend_adapters",
                                 "LoRA adapters each backend holds, as control knows them.",
                                 labels=["backend"])  # fmt: skip
        room = GaugeMetricFamily("baton_backend_max_adapters",
                                 "LoRA adapters each backend may hold at once (its max_lora).",
                                 labels=["backend"])  # fmt: skip
        for b in snap.backends:
            if b.serves_adapters():
                held.add_metric([b.backend.id], len(b.adapters))
                room.add_metric([b.backend.id], b.max_adapters)
        yield held
        yield room

    def _kv(self) -> Iterator[Metric]:
        """Each backend's KV-cache index: its state (1 on the current one; `off` without
        kv_events), the blocks it holds, and the engine events applied to it."""
        kv = self._registry.kv_status()
        state = GaugeMetricFamily("baton_kv_index_state", "KV-cache index state per backend.",
                                  labels=["backend", "state"])  # fmt: skip
        blocks = GaugeMetricFamily(
            "baton_kv_blocks", "Prefix blocks each backend's engine holds, as its index knows.",
            labels=["backend"],
        )
        events = CounterMetricFamily(
            "baton_kv_events", "KV-cache events applied to the index (stored, removed, cleared).",
            labels=["backend", "event"],
        )
        for b in self._registry.backends:
            s = kv.get(b.id)
            current = s.state if s is not None else KvState.OFF
            for st in KvState:
                state.add_metric([b.id, st.value], 1.0 if st is current else 0.0)
            if s is not None:
                blocks.add_metric([b.id], s.blocks)
                for name in ("stored", "removed", "cleared"):
                    events.add_metric([b.id, name], s.events.get(name, 0))
        yield state
        yield blocks
        yield events


class TenantCollector(Collector):
    """Each tenant's use since control started, read from the tenant book at scrape time
    (the route path only counts). The tenant label is bounded by the operator's tenants:
    `default` for the shims' flat key file; any other id (a tenant removed since) is `other`."""

    def __init__(
        self,
        registry: Registry,
        queued: Callable[[], Mapping[str, int]] | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._queued = queued
        self._now = now  # control's clock: which budget period is current

    def collect(self) -> Iterator[Metric]:
        book = self._registry.tenants
        known = {t.id for t in book.all()} | {FILE_TENANT}
        fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "requests": CounterMetricFamily(
                "baton_tenant_requests", "Requests admitted, by tenant.", labels=["tenant"]
            ),
            "refused": CounterMetricFamily(
                "baton_tenant_refused",
                "Requests refused at admission, by tenant and by what refused them "
                "(concurrent, requests, tokens, model, saturated).",
                labels=["tenant", "limit"],
            ),
            "tokens": CounterMetricFamily(
                "baton_tenant_tokens", "Tokens the engines counted, by tenant.",
                labels=["tenant", "kind"],
            ),
            "queued": CounterMetricFamily(
                "baton_tenant_queued_seconds",
                "Seconds requests waited for room on a saturated fleet, by tenant.",
                labels=["tenant"],
            ),
            "in_flight": GaugeMetricFamily(
                "baton_tenant_in_flight", "Requests admitted and not finished, by tenant.",
                labels=["tenant"],
            ),
        }  # fmt: skip
        rows: dict[str, list[float]] = {}
        refused: Tally[tuple[str, str]] = Tally()
        for u in book.usage(lifetime=True):
            tid = u.tenant_id if u.tenant_id in known else "other"
            row = rows.setdefault(tid, [0.0] * 5)
            for i, v in enumerate((u.requests, u.prompt_tokens, u.completion_tokens,
                                   u.queued_s, u.in_flight)):  # fmt: skip
                row[i] += v
            for limit, n in u.refused.items():
                refused[(tid, limit)] += n
        for tid, (requests, prompt, completion, queued, in_flight) in rows.items():
            fams["requests"].add_metric([tid], requests)
            fams["tokens"].add_metric([tid, "prompt"], prompt)
            fams["tokens"].add_metric([tid, "completion"], completion)
            fams["queued"].add_metric([tid], queued)
            fams["in_flight"].add_metric([tid], in_flight)
        for (tid, limit), n in refused.items():
            fams["refused"].add_metric([tid, limit], n)
        yield from fams.values()
        reached = CounterMetricFamily(
            "baton_tenant_budget_reached",
            "Budgets a tenant's spend reached, once per period, by tenant, period and kind "
            "(hard: refused until it resets; soft: said only).",
            labels=["tenant", "period", "kind"],
        )
        by_label: Tally[tuple[str, str, str]] = Tally()
        for (tid, period, soft), n in book.reached.items():
            by_label[(tid if tid in known else "other", period, "soft" if soft else "hard")] += n
        for labels, n in sorted(by_label.items()):
            reached.add_metric(list(labels), n)
        yield reached
        yield from _spend(book, self._now())
        yield GaugeMetricFamily(
            "baton_spend_unwritten",
            "Tenants' settled spend not yet written to fleet.db (or to etcd, on a control "
            "replica's leader), in currency units: what a crash would lose now.",
            float(amount(book.spend.unwritten_units)),
        )
        if self._queued is not None:
            waiting = GaugeMetricFamily(
                "baton_queued_requests",
                "Requests waiting for room on a saturated fleet, by priority class.",
                labels=["priority"],
            )
            for band, n in self._queued().items():
                waiting.add_metric([band], n)
            yield waiting


def _spend(book: TenantBook, now: float) -> Iterator[GaugeMetricFamily]:
    """Each budgeted tenant's spend and what is left, per period ("day:UTC"): labels bounded
    by the operator's tenants and their budgets. Budgets on one period share its spend; what
    is left is the least of its hard budgets' (of its soft ones' where it has none)."""
    spend = GaugeMetricFamily(
        "baton_tenant_spend",
        "Settled spend in the current period (currency units), by tenant and period.",
        labels=["tenant", "period"],
    )
    remaining = GaugeMetricFamily(
        "baton_tenant_budget_remaining",
        "What the tenant's budget leaves in the current period (currency units, in-flight "
        "estimates taken off), by tenant and period.",
        labels=["tenant", "period"],
    )
    for t in book.all():
        left: dict[str, tuple[bool, int]] = {}  # period -> (soft, remaining)
        for s in book.standing(t.id, now):
            period = s.budget.calendar.name
            if period not in left:
                spend.add_metric([t.id, period], float(amount(s.spent)))
            best = left.get(period)
            this = (s.budget.soft, s.remaining)
            if best is None or this < best:  # hard before soft, then the least left
                left[period] = this
        for period, (_, units_left) in left.items():
            remaining.add_metric([t.id, period], float(amount(units_left)))
    yield spend
    yield remaining


class ReplicaCollector(Collector):
    """A control replica's role, its store's health and its followers (docs/replicas.md):
    what to alert on is no replica leading, or etcd not answering."""

    def __init__(
        self,
        leading: Callable[[], bool],
        store_up: Callable[[], bool],
        followers: Callable[[], int],
    ) -> None:
        self._leading = leading
        self._store_up = store_up
        self._followers = followers

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "baton_replica_leading", "1 while this control replica leads.", float(self._leading())
        )
        yield GaugeMetricFamily(
            "baton_replica_store_up", "1 while etcd answers this replica.", float(self._store_up())
        )
        yield GaugeMetricFamily(
            "baton_replica_followers",
            "Replicas following this leader's soft state.",
            float(self._followers()),
        )


class ControlMetrics:
    def __init__(
        self,
        registry: Registry,
        pairs: PairFlow,
        now: Callable[[], float] = time.time,
        queued: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routes = Counter(
            "baton_routes", "Routing decisions.", ["policy", "reason"], registry=r
        )
        self.route_seconds = Histogram(
            "baton_route_decision_seconds",
            "Time control spends deciding one route.",
            buckets=ROUTE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "baton_retries", "Attempts that failed before the first byte.", ["backend"], registry=r
        )
        self.failovers = Counter(
            "baton_failovers",
            "Mid-stream failovers as shims reported them.",
            ["failure", "seam", "outcome"],
            registry=r,
        )
        self.failover_gap = Histogram(
            "baton_failover_gap_seconds",
            "Failure detected to first resumed byte.",
            registry=r,
            buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.pair_verdicts = Counter(
            "baton_pair_gate_verdicts",
            "Post-failover pairing gate verdicts.",
            ["verdict"],
            registry=r,
        )
        self.adapter_loads = Counter(
            "baton_adapter_loads",
            "LoRA adapter loads Baton asked of engines, by backend and outcome (ok, failed).",
            ["backend", "outcome"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "baton_adapter_load_seconds",
            "Time from asking an engine to load an adapter (evictions first included) to its "
            "answer.",
            registry=r,
            buckets=(5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )
        self.adapter_unloads = Counter(
            "baton_adapter_unloads",
            "LoRA adapters Baton unloaded, by backend and why (evict: room for another; admin).",
            ["backend", "why"],
            registry=r,
        )
        r.register(FleetCollector(registry, pairs, now))
        r.register(TenantCollector(registry, queued, now))
