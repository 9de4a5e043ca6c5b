"""The control plane's TOML config: backends and settings. Bad config fails loudly at load."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from baton.model import Backend
from control.backend_spec import (
    BACKEND_KEYS,
    check_ranks,
    data_parallel_ranks,
    make_backend,
    pair_spec,
)
from control.exceptions import ConfigError
from control.routing.policy import DEFAULT_POLICY, KV_DEFAULT_POLICY, POLICIES
from control.settings import (
    AffinitySettings,
    AuditSettings,
    HealthPolicy,
    KvSettings,
    LoadSettings,
    PairSpec,
    ProbeSettings,
)


@dataclass(frozen=True, slots=True)
class Config:
    backends: tuple[Backend, ...] = ()
    routing: str = DEFAULT_POLICY
    probes: ProbeSettings = field(default_factory=ProbeSettings)
    health: HealthPolicy = field(default_factory=HealthPolicy)
    affinity: AffinitySettings = field(default_factory=AffinitySettings)
    audit: AuditSettings = field(default_factory=AuditSettings)
    pairs: tuple[PairSpec, ...] = ()
    load: LoadSettings = field(default_factory=LoadSettings)
    kv: KvSettings = field(default_factory=KvSettings)


# What ZMQ's connect takes, and nothing it would refuse later inside a subscriber task: a
# host name, an IPv4 address or a bracketed IPv6 one (never the `*` wildcard an engine binds);
# an ipc path of printable characters that fits a Unix socket address (107 bytes; a leading
# "@" is Linux's abstract namespace).


def parse(data: dict[str, Any]) -> Config:
    routing = data.get("routing", DEFAULT_POLICY)
    if routing not in POLICIES:
        raise ConfigError(f"routing must be one of {', '.join(sorted(POLICIES))}, got {routing!r}")
    backends = []
    for i, raw in enumerate(data.get("backends", [])):
        if not isinstance(raw, dict):
            raise ConfigError(f"backends[{i}] must be a table")
        unknown = set(raw) - BACKEND_KEYS
        if unknown:
            raise ConfigError(f"backends[{i}]: unknown keys {sorted(unknown)}")
        missing = {"id", "url", "model"} - set(raw)
        if missing:
            raise ConfigError(f"backends[{i}]: missing {sorted(missing)}")
        backends += [make_backend(**one) for one in data_parallel_ranks(raw)]
    ids = [b.id for b in backends]
    if len(ids) != len(set(ids)):
        raise ConfigError("backend ids must be unique")
    check_ranks(backends)
    probes = ProbeSettings(**_table(data, "probes", ProbeSettings))
    health = HealthPolicy(**_table(data, "health", HealthPolicy))
    affinity = AffinitySettings(**_table(data, "affinity", AffinitySettings))
    audit = AuditSettings(**_table(data, "audit", AuditSettings))
    pairs = tuple(pair_spec(raw, f"pairs[{i}]") for i, raw in enumerate(data.get("pairs", [])))
    load = LoadSettings(**_table(data, "load", LoadSettings))
    kv = KvSettings(**_table(data, "kv", KvSettings))
    if "routing" not in data and any(b.kv_events for b in backends):
        # The engines say what they hold: predict from it. `adaptive` stays selectable.
        routing = KV_DEFAULT_POLICY
    return Config(tuple(backends), routing, probes, health, affinity, audit, pairs, load, kv)


def with_routing(cfg: Config, routing: str) -> Config:
    if routing not in POLICIES:
        raise ConfigError(f"routing must be one of {', '.join(sorted(POLICIES))}, got {routing!r}")
    return replace(cfg, routing=routing)


def _table(data: dict[str, Any], key: str, cls: type) -> dict[str, Any]:
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise ConfigError(f"[{key}] must be a table")
    unknown = set(table) - {f.name for f in fields(cls)}
    if unknown:
        raise ConfigError(f"[{key}]: unknown keys {sorted(unknown)}")
    return dict(table)


def load(path: Path | None) -> Config:
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    return parse(data)
