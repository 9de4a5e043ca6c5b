"""The control plane's settings, one dataclass per config table ([probes], [health], [load],
[affinity], [audit], [kv], [[pairs]]): what control/config.py reads from TOML and each part of
control takes its own piece of, as dataplane/settings.py is for the shim."""

# baton: pure

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    readmit_after: int = 2  # consecutive good probes to re-admit a demoted/down backend
    down_after: int = 3  # consecutive failed probes to call a demoted backend down
    # Consecutive probes that time out to demote a healthy backend. An engine that answers
    # its probe late is alive and may only be busy (a loaded CPU host, a long prefill); one
    # that refuses, resets or answers an error is demoted on the first.
    slow_after: int = 2


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    interval: float = 2.0
    timeout: float = 1.0
    jitter: float = 0.2  # fraction of the interval, so probes of many backends don't align


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """Reading each engine's own load gauges (control/signals/engine_load.py); interval 0 turns it
    off."""

    interval: float = 1.0
    timeout: float = 1.0
    stale_after: float = 3.0  # seconds; an older reading is not used for routing


@dataclass(frozen=True, slots=True)
class AffinitySettings:
    pin_capacity: int = 100_000  # pins kept (LRU beyond)
    pin_ttl: float = 1800.0  # seconds a pin lives without use
    spill_factor: float = 2.0  # adaptive: spill when pinned in-flight > factor x mean + slack
    spill_slack: int = 2
    # Ownership pins (control/fleet/owners.py): which backend holds each stored Responses API
    # response.
    owner_capacity: int = 100_000
    owner_ttl: float = 86_400.0  # seconds without use; keep it >= the engines' own store TTL


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """[admission]: requests wait in priority bands when the fleet is saturated (docs/
    tenants.md#priority-and-fair-share). Off while `backend_capacity` is unset: a request
    goes to an engine at once, as before, and the engine's own queue holds it."""

    # Requests one backend serves at once before it counts as full (an engine that reports
    # requests waiting in its own queue is full too).
    backend_capacity: int | None = None
    # The share of each backend's capacity a band leaves to the bands above it: interactive
    # may fill it, standard all but `headroom`, batch all but twice that (at least 1 each).
    headroom: float = 0.1
    max_wait: float = 10.0  # seconds a request may wait for room; then 429 with Retry-After
    max_queued: int = 10_000  # requests waiting at once; beyond, the lowest band's newest go

    def __post_init__(self) -> None:
        if self.backend_capacity is not None and self.backend_capacity < 1:
            raise ValueError("[admission] backend_capacity must be at least 1")
        if not 0 <= self.headroom < 0.5:
            raise ValueError("[admission] headroom must be in [0, 0.5)")
        if self.max_wait <= 0 or self.max_queued < 1:
            raise ValueError("[admission] max_wait and max_queued must be positive")

    @property
    def enabled(self) -> bool:
        return self.backend_capacity is not None

    def capacity(self, band: int) -> int:
        """What a backend may hold before band `band` (0 first) counts it as full."""
        cap = self.backend_capacity or 0
        return max(1, cap - round(cap * self.headroom * band))


@dataclass(frozen=True, slots=True)
class AuditSettings:
    # One event per routing decision. Off keeps failover, retry, health and admin events and
    # saves the per-route cost (bench/events.py measures it).
    route_events: bool = True


@dataclass(frozen=True, slots=True)
class KvSettings:
    capacity: int = 1_000_000  # blocks indexed per backend (the oldest stored go beyond)
    replay_timeout: float = 2.0  # seconds to wait for an engine's replay of missed batches
    # ZMTP heartbeats on each subscription: a peer that answers none for `heartbeat_timeout`
    # seconds is disconnected (a crashed host sends no FIN; an idle engine sends no events).
    heartbeat: float = 1.0
    heartbeat_timeout: float = 3.0


@dataclass(frozen=True, slots=True)
class PairSpec:
    """A pair to bind once both backends have told control their facts (never from here)."""

    draft: str
    target: str
    num_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """[lora]: where LoRA adapters' requests go and when adapters are loaded (control/routing/
    adapters.py; docs/routing.md#adapter-fleets)."""

    # Requests a second of one adapter that one replica takes before the adapter spreads to
    # another (its home set grows by one replica per this much demand).
    per_replica_rate: float = 8.0
    # Requests in flight at which a replica counts as saturated for placement (0: never).
    saturated_at: int = 0
    # An adapter used within this many seconds is not unloaded to make room for another.
    min_idle: float = 2.0
    # How long a request waits for its adapter to load before it is refused.
    load_timeout: float = 60.0
    # A load that failed on a backend is not tried there again for this long.
    retry_after: float = 30.0
    # Seconds between reads of each engine's adapters (/v1/models, max_lora); 0: never.
    refresh: float = 5.0
    # Demand is a request rate decayed with this half-life, in seconds.
    half_life: float = 30.0
    # How many adapters Baton keeps loaded on each adapter engine. 0: the engine's own
    # max_lora (its --max-loras, read from its /metrics once it has run a request under an
    # adapter; 1, vLLM's default, until then). Set it to the fleet's --max-cpu-loras when that
    # is larger: the engine keeps that many in memory, and only --max-loras of them run in
    # one batch.
    max_adapters: int = 0

    def __post_init__(self) -> None:
        for name in ("per_replica_rate", "load_timeout", "half_life"):
            if getattr(self, name) <= 0:
                raise ValueError(f"[lora] {name} must be > 0")
        for name in ("saturated_at", "min_idle", "retry_after", "refresh", "max_adapters"):
            if getattr(self, name) < 0:
                raise ValueError(f"[lora] {name} must be >= 0")
