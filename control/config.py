"""The control plane's TOML config: backends, tenants and settings. Bad config fails loudly at
load."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from baton.budgets import parse_budgets
from baton.model import Adapter, Backend
from baton.pricing import PriceTable
from baton.tenancy import Limits, Priority, Tenant, TenantKey, id_problem
from control.backend_spec import (
    BACKEND_KEYS,
    check_ranks,
    data_parallel_ranks,
    make_backend,
    pair_spec,
)
from control.discovery.settings import DiscoverySettings
from control.discovery.settings import parse as parse_discovery
from control.exceptions import ConfigError
from control.routing.policy import DEFAULT_POLICY, KV_DEFAULT_POLICY, POLICIES
from control.settings import (
    AdmissionSettings,
    AffinitySettings,
    AuditSettings,
    HealthPolicy,
    KvSettings,
    LoadSettings,
    LoraSettings,
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
    tenants: tuple[Tenant, ...] = ()
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    adapters: tuple[Adapter, ...] = ()
    lora: LoraSettings = field(default_factory=LoraSettings)
    prices: PriceTable = field(default_factory=PriceTable)
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)


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
    tenants = _tenants(data.get("tenants", []))
    try:
        admission = AdmissionSettings(**_table(data, "admission", AdmissionSettings))
        lora = LoraSettings(**_table(data, "lora", LoraSettings))
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    adapters = _adapters(data.get("adapters", []), {b.model for b in backends})
    return Config(tuple(backends), routing, probes, health, affinity, audit, pairs, load, kv,
                  tenants, admission, adapters, lora, _prices(data.get("prices", {})),
                  parse_discovery(data.get("discovery", {})))  # fmt: skip


def _prices(raw: object) -> PriceTable:
    """[prices."MODEL"]: input, output, cached_input per million tokens (baton/pricing.py)."""
    if not isinstance(raw, dict):
        raise ConfigError('prices must be a table of models ([prices."MODEL"])')
    try:
        return PriceTable.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"prices: {exc}") from None


def _adapters(raw: object, models: set[str]) -> tuple[Adapter, ...]:
    """[[adapters]]: name, base, source. An adapter may not take a backend's model's name
    (a request naming it would be ambiguous)."""
    if not isinstance(raw, list):
        raise ConfigError("adapters must be an array of tables ([[adapters]])")
    out: list[Adapter] = []
    for i, t in enumerate(raw):
        where = f"adapters[{i}]"
        if not isinstance(t, dict):
            raise ConfigError(f"{where} must be a table")
        if set(t) - {"name", "base", "source"} or not {"name", "base", "source"} <= set(t):
            raise ConfigError(f"{where}: takes exactly name, base and source, got {sorted(t)}")
        if not all(isinstance(t[k], str) and t[k] for k in ("name", "base", "source")):
            raise ConfigError(f"{where}: name, base and source must be non-empty strings")
        if t["name"] in models:
            raise ConfigError(f"{where}: {t['name']!r} is a backend's model, not an adapter")
        out.append(Adapter(t["name"], t["base"], t["source"]))
    names = [a.name for a in out]
    if len(names) != len(set(names)):
        raise ConfigError("adapter names must be unique")
    return tuple(out)


TENANT_KEYS = frozenset({"id", "priority", "weight", "concurrent", "requests_per_minute",
                         "tokens_per_minute", "models", "key_sha256", "budgets"})  # fmt: skip


def _tenants(raw: object) -> tuple[Tenant, ...]:
    if not isinstance(raw, list):
        raise ConfigError("tenants must be an array of tables ([[tenants]])")
    out = tuple(_tenant(t, f"tenants[{i}]") for i, t in enumerate(raw))
    ids = [t.id for t in out]
    if len(ids) != len(set(ids)):
        raise ConfigError("tenant ids must be unique")
    digests = [k.digest for t in out for k in t.keys]
    if len(digests) != len(set(digests)):
        raise ConfigError("a key_sha256 is listed twice: each key belongs to one tenant, once")
    return out


def _tenant(raw: object, where: str) -> Tenant:
    """One [[tenants]] table. Keys are given by SHA-256 digest only, so the file holds no
    credential; a value that is not a digest is refused without being echoed (it may be a
    key pasted by mistake)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(raw) - TENANT_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    tid = raw.get("id")
    if not isinstance(tid, str):
        raise ConfigError(f"{where}: missing id (a string)")
    why = id_problem(tid)
    if why is not None:
        raise ConfigError(f"{where}: {why}")
    priority = raw.get("priority", Priority.STANDARD.value)
    if priority not in Priority._value2member_map_:
        raise ConfigError(f"{where}: priority must be one of {', '.join(Priority)}")
    models = raw.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f"{where}: models must be a list of model names")
    digests = raw.get("key_sha256", [])
    if not isinstance(digests, list):
        raise ConfigError(f"{where}: key_sha256 must be a list of SHA-256 digests")
    limits = Limits(
        _count(raw, "concurrent", where),
        _count(raw, "requests_per_minute", where),
        _count(raw, "tokens_per_minute", where),
        frozenset(models),
    )
    weight = _count(raw, "weight", where)
    keys = tuple(TenantKey(_digest(d, f"{where}: key_sha256[{j}]"), 0.0)
                 for j, d in enumerate(digests))  # fmt: skip
    budgets = raw.get("budgets", [])
    if not isinstance(budgets, list):
        raise ConfigError(f"{where}: budgets must be an array of tables "
                          '([{amount = 50, period = "day"}])')  # fmt: skip
    try:
        budget = parse_budgets(budgets)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return Tenant(tid, Priority(priority), 1 if weight is None else weight, limits, keys, budget)


def _count(raw: dict[str, Any], key: str, where: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    top = 2**64 if key == "tokens_per_minute" else 2**32  # the wire's uint64 and uint32
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < top:
        raise ConfigError(f"{where}: {key} must be a whole number of at least 1 (or absent)")
    return value


def _digest(value: object, where: str) -> bytes:
    if isinstance(value, str) and len(value) == 64:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    raise ConfigError(
        f"{where} is not a SHA-256 digest (64 hex digits, from "
        f'`printf %s "$KEY" | sha256sum`); the value is not shown, in case it is a key'
    )


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
