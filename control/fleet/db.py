"""What operators configured at run time, in an embedded SQLite database (stdlib sqlite3) in
control's data dir, so a restarted control plane comes back with the same fleet.

Kept: backends added at run time, config backends removed at run time, drains (with their
`migrate` flag), speculative pairs (as bound: draft, the target the operator chose, k),
tenants added, changed or removed at run time (their keys by digest only: a key itself is
never written), and prices set or unset at run time (control/fleet/prices.py). Not kept:
health, pins, load and tenants' use (soft state, rebuilt from probes and traffic), and pair
facts (read anew from both backends before a pair is bound again: what held before a
restart is not trusted).

The config file stays the base: the database holds an overlay on it (added, removed), so a
backend or tenant later added to the config file still appears. One removed at run time
stays removed even if the config still lists it, and one changed at run time (a tenant's
new key, say) replaces the file's of its id: the operator's latest word wins; `baton
backends add` and `baton tenants add` bring them back.

Writes happen on admin changes only (rare), never on the routing path; each is one
transaction replacing the whole (tiny) configuration, so a crash leaves the old state or the
new, never half. WAL with synchronous=NORMAL: a commit survives the process being killed
(what a control restart is) without an fsync per change."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baton.budgets import Budget, parse_budgets
from baton.model import Backend, BackendId
from baton.pricing import Price, PriceTable, amount
from baton.tenancy import Limits, Priority, Tenant, TenantKey
from control.backend_spec import make_backend
from control.exceptions import ConfigError
from control.fleet.prices import laid_over, price_from_row, price_overlay, price_row
from control.settings import PairSpec

SCHEMA_VERSION = 7
_SCHEMA = """
CREATE TABLE IF NOT EXISTS added (
    id TEXT PRIMARY KEY, url TEXT NOT NULL, model TEXT NOT NULL,
    kind TEXT NOT NULL, role TEXT NOT NULL, api_key_env TEXT NOT NULL DEFAULT '',
    reasoning_parser TEXT NOT NULL DEFAULT '', tool_parser TEXT NOT NULL DEFAULT '',
    kv_events TEXT NOT NULL DEFAULT '', kv_events_replay TEXT NOT NULL DEFAULT '',
    data_parallel_rank INTEGER
);
CREATE TABLE IF NOT EXISTS removed (id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS drained (id TEXT PRIMARY KEY, migrate INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pairs (
    draft TEXT PRIMARY KEY, target TEXT NOT NULL, num_draft_tokens INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY, priority TEXT NOT NULL, weight INTEGER NOT NULL,
    limits TEXT NOT NULL, keys TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tenants_removed (id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS prices (
    model TEXT PRIMARY KEY, input TEXT NOT NULL, cached_input TEXT NOT NULL, output TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS prices_unset (model TEXT PRIMARY KEY);
"""
_TABLES = ("added", "removed", "drained", "pairs", "tenants", "tenants_removed", "prices",
           "prices_unset")  # fmt: skip

_ADDED_LATER = ("api_key_env", "reasoning_parser", "tool_parser", "kv_events",
                "kv_events_replay")  # fmt: skip
_RANK = "data_parallel_rank"  # an INTEGER, NULL for none (schema 5)
# A backend's row: each column is the Backend field (and make_backend argument) of its name.
BACKEND_COLUMNS = ("id", "url", "model", "kind", "role", *_ADDED_LATER, _RANK)


@dataclass(frozen=True, slots=True)
class Configured:
    added: tuple[Backend, ...] = ()  # added at run time, or re-added with other fields
    removed: frozenset[str] = frozenset()  # config backends removed at run time
    drained: Mapping[str, bool] = field(default_factory=dict)  # id -> migrate
    pairs: tuple[PairSpec, ...] = ()
    tenants: tuple[Tenant, ...] = ()  # added or changed at run time (keys by digest)
    tenants_removed: frozenset[str] = frozenset()  # config tenants removed at run time
    prices: Mapping[str, Price] = field(default_factory=dict)  # set at run time, by model
    prices_unset: frozenset[str] = frozenset()  # config prices unset at run time


def overlay(config: Iterable[Backend], current: Iterable[Backend]) -> Configured:
    """The difference between the config file's backends and the registry's now."""
    base = {b.id: b for b in config}
    now = {b.id: b for b in current}
    return Configured(
        added=tuple(b for bid, b in sorted(now.items()) if base.get(bid) != b),
        removed=frozenset(bid for bid in base if bid not in now),
    )


def shadowed(config: Iterable[Backend], saved: Configured) -> list[Backend]:
    """The config file's backends that a saved run-time addition of the same id replaces
    (with other fields): the saved one wins, and control says so at start."""
    added = {b.id: b for b in saved.added}
    return [b for b in config if b.id in added and added[b.id] != b]


def fleet(config: Iterable[Backend], saved: Configured) -> list[Backend]:
    """The config's backends minus those removed, plus (replacing by id) those added."""
    out = {b.id: b for b in config if b.id not in saved.removed}
    out.update((b.id, b) for b in saved.added)
    return list(out.values())


def tenant_overlay(
    config: Iterable[Tenant], current: Iterable[Tenant]
) -> tuple[tuple[Tenant, ...], frozenset[str]]:
    """(added or changed, removed): the difference between the config file's tenants and the
    registry's now, as for backends."""
    base = {t.id: t for t in config}
    now = {t.id: t for t in current}
    return (
        tuple(t for tid, t in sorted(now.items()) if base.get(tid) != t),
        frozenset(tid for tid in base if tid not in now),
    )


def tenants(config: Iterable[Tenant], saved: Configured) -> list[Tenant]:
    """The config's tenants minus those removed, plus (replacing by id) those saved."""
    out = {t.id: t for t in config if t.id not in saved.tenants_removed}
    out.update((t.id, t) for t in saved.tenants)
    return list(out.values())


def prices(config: PriceTable, saved: Configured) -> PriceTable:
    """The config's prices with those set and unset at run time laid over them."""
    return laid_over(config, saved.prices, saved.prices_unset)


def shadowed_tenants(config: Iterable[Tenant], saved: Configured) -> list[Tenant]:
    """The config file's tenants that one saved at run time replaces (control says so)."""
    kept = {t.id: t for t in saved.tenants}
    return [t for t in config if t.id in kept and kept[t.id] != t]


def tenant_row(t: Tenant) -> tuple[str, str, int, str, str]:
    lim = t.limits
    limits: dict[str, object] = {**dict(lim.rates()), "models": sorted(lim.models)}
    if t.budgets:  # with the limits: one more key in a JSON column, no new schema
        limits["budgets"] = [budget_row(b) for b in t.budgets]
    keys = [{"sha256": k.digest.hex(), "created": k.created} for k in t.keys]
    return t.id, t.priority.value, t.weight, json.dumps(limits), json.dumps(keys)


def tenant_from_row(tid: str, priority: str, weight: int, limits: str, keys: str) -> Tenant:
    """A saved row; anything that is not what tenant_row writes is refused (ConfigError)."""
    try:
        lim: dict[str, Any] = json.loads(limits)
        made: list[dict[str, Any]] = json.loads(keys)
        return Tenant(
            tid,
            Priority(priority),
            int(weight),
            Limits(
                _count(lim["concurrent"]),
                _count(lim["requests_per_minute"]),
                _count(lim["tokens_per_minute"]),
                frozenset(map(str, lim["models"])),
            ),
            tuple(TenantKey(_digest(k["sha256"]), float(k["created"])) for k in made),
            parse_budgets(lim.get("budgets", [])),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"tenant {tid!r}: unreadable row ({exc})") from None


def budget_row(b: Budget) -> dict[str, object]:
    """A budget as config writes it (parse_budgets reads it back): the amount as a string,
    exact."""
    cal = b.calendar
    return {"amount": format(amount(b.amount), "f"), "period": cal.period.value, "zone": cal.zone,
            "soft": b.soft}  # fmt: skip


def _count(value: object) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"a limit is a whole number or null, not {value!r}")


def _digest(text: str) -> bytes:
    digest = bytes.fromhex(text)
    if len(digest) != 32:
        raise ValueError("a key digest is 32 bytes (SHA-256)")
    return digest


class FleetDB:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(path, isolation_level=None)  # explicit BEGIN/COMMIT
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ConfigError(f"{path}: written by a newer Baton (schema {version})")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(added)")}
            # Columns later versions added, in order (version 1 had no key, 2 no parsers, 3 no
            # KV events, 4 no ranks): an older database gets them with their empty default,
            # which is what it meant. Version 5 had no tenant tables, 6 no price tables: _SCHEMA
            # makes them empty.
            for column in _ADDED_LATER:
                if column not in columns:
                    self._db.execute(
                        f"ALTER TABLE added ADD COLUMN {column} TEXT NOT NULL DEFAULT ''"
                    )
            if _RANK not in columns:
                self._db.execute(f"ALTER TABLE added ADD COLUMN {_RANK} INTEGER")
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            # Refuse to start rather than come back silently without the operator's fleet.
            raise ConfigError(f"{path}: not a usable fleet database ({exc})") from None

    def load(self) -> Configured:
        q = self._db.execute
        try:
            added = tuple(
                make_backend(**dict(zip(BACKEND_COLUMNS, row, strict=True)))
                for row in q(f"SELECT {', '.join(BACKEND_COLUMNS)} FROM added")  # noqa: S608
            )
            return Configured(
                added=added,
                removed=frozenset(r[0] for r in q("SELECT id FROM removed")),
                drained={r[0]: bool(r[1]) for r in q("SELECT id, migrate FROM drained")},
                pairs=tuple(
                    PairSpec(d, t, k)
                    for d, t, k in q("SELECT draft, target, num_draft_tokens FROM pairs")
                ),
                tenants=tuple(
                    tenant_from_row(*row)
                    for row in q("SELECT id, priority, weight, limits, keys FROM tenants")
                ),
                tenants_removed=frozenset(r[0] for r in q("SELECT id FROM tenants_removed")),
                prices={
                    r[0]: price_from_row(*r)
                    for r in q("SELECT model, input, cached_input, output FROM prices")
                },
                prices_unset=frozenset(r[0] for r in q("SELECT model FROM prices_unset")),
            )
        except (sqlite3.DatabaseError, ConfigError) as exc:
            raise ConfigError(f"{self.path}: {exc}") from None

    def save(self, state: Configured) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for table in _TABLES:
                db.execute(f"DELETE FROM {table}")  # noqa: S608 - names from the tuple above
            db.executemany(
                f"INSERT INTO added ({', '.join(BACKEND_COLUMNS)}) "  # noqa: S608 - names above
                f"VALUES ({', '.join('?' * len(BACKEND_COLUMNS))})",
                [(*(str(getattr(b, c)) for c in BACKEND_COLUMNS[:-1]), b.data_parallel_rank)
                 for b in state.added],  # fmt: skip
            )
            db.executemany("INSERT INTO removed VALUES (?)", [(i,) for i in sorted(state.removed)])
            db.executemany(
                "INSERT INTO drained VALUES (?, ?)",
                [(i, int(m)) for i, m in sorted(state.drained.items())],
            )
            db.executemany(
                "INSERT INTO pairs VALUES (?, ?, ?)",
                [(p.draft, p.target, p.num_draft_tokens) for p in state.pairs],
            )
            rows = [tenant_row(t) for t in state.tenants]
            db.executemany("INSERT INTO tenants VALUES (?, ?, ?, ?, ?)", rows)
            db.executemany(
                "INSERT INTO tenants_removed VALUES (?)",
                [(i,) for i in sorted(state.tenants_removed)],
            )
            db.executemany("INSERT INTO prices VALUES (?, ?, ?, ?)",
                           [price_row(m, p) for m, p in sorted(state.prices.items())])  # fmt: skip
            db.executemany("INSERT INTO prices_unset VALUES (?)",
                           [(m,) for m in sorted(state.prices_unset)])  # fmt: skip
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()


def configured(
    config: Sequence[Backend],
    current: Iterable[Backend],
    drained: Mapping[BackendId, bool],
    pairs: Iterable[PairSpec],
    *,
    config_tenants: Iterable[Tenant] = (),
    current_tenants: Iterable[Tenant] = (),
    config_prices: PriceTable | None = None,
    current_prices: PriceTable | None = None,
) -> Configured:
    """What to save: the backend overlay, the drains, the pairs (one per draft), the
    tenant overlay and the price overlay, now."""
    diff = overlay(config, current)
    unique = tuple({p.draft: p for p in pairs}.values())
    added, removed = tenant_overlay(config_tenants, current_tenants)
    base = config_prices or PriceTable()
    priced, unset = price_overlay(base, base if current_prices is None else current_prices)
    return Configured(diff.added, diff.removed, {str(k): v for k, v in drained.items()}, unique,
                      added, removed, priced, unset)  # fmt: skip
