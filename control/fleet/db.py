"""What operators configured at run time, in an embedded SQLite database (stdlib sqlite3) in
control's data dir, so a restarted control plane comes back with the same fleet.

Kept: backends added at run time, config backends removed at run time, drains (with their
`migrate` flag) and speculative pairs (as bound: draft, the target the operator chose, k).
Not kept: health, pins and load (soft state, rebuilt from probes and traffic), and pair facts
(read anew from both backends before a pair is bound again: what held before a restart is
not trusted).

The config file stays the base: the database holds an overlay on it (added, removed), so a
backend later added to the config file still appears. A backend removed at run time stays
removed even if the config still lists it: the operator's latest word wins; `baton backends
add` brings it back.

Writes happen on admin changes only (rare), never on the routing path; each is one
transaction replacing the whole (tiny) configuration, so a crash leaves the old state or the
new, never half. WAL with synchronous=NORMAL: a commit survives the process being killed
(what a control restart is) without an fsync per change."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from baton.model import Backend, BackendId
from control.backend_spec import make_backend
from control.exceptions import ConfigError
from control.settings import PairSpec

SCHEMA_VERSION = 5
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
"""

_ADDED_LATER = ("api_key_env", "reasoning_parser", "tool_parser", "kv_events",
                "kv_events_replay")  # fmt: skip
_RANK = "data_parallel_rank"  # an INTEGER, NULL for none (schema 5)
# A backend's row: each column is the Backend field (and make_backend argument) of its name.
_ADDED_COLUMNS = ("id", "url", "model", "kind", "role", *_ADDED_LATER, _RANK)


@dataclass(frozen=True, slots=True)
class Configured:
    added: tuple[Backend, ...] = ()  # added at run time, or re-added with other fields
    removed: frozenset[str] = frozenset()  # config backends removed at run time
    drained: Mapping[str, bool] = field(default_factory=dict)  # id -> migrate
    pairs: tuple[PairSpec, ...] = ()


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
            # which is what it meant.
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
                make_backend(**dict(zip(_ADDED_COLUMNS, row, strict=True)))
                for row in q(f"SELECT {', '.join(_ADDED_COLUMNS)} FROM added")  # noqa: S608
            )
            return Configured(
                added=added,
                removed=frozenset(r[0] for r in q("SELECT id FROM removed")),
                drained={r[0]: bool(r[1]) for r in q("SELECT id, migrate FROM drained")},
                pairs=tuple(
                    PairSpec(d, t, k)
                    for d, t, k in q("SELECT draft, target, num_draft_tokens FROM pairs")
                ),
            )
        except (sqlite3.DatabaseError, ConfigError) as exc:
            raise ConfigError(f"{self.path}: {exc}") from None

    def save(self, state: Configured) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for table in ("added", "removed", "drained", "pairs"):
                db.execute(f"DELETE FROM {table}")  # noqa: S608 - names from the tuple above
            db.executemany(
                f"INSERT INTO added ({', '.join(_ADDED_COLUMNS)}) "  # noqa: S608 - names above
                f"VALUES ({', '.join('?' * len(_ADDED_COLUMNS))})",
                [(*(str(getattr(b, c)) for c in _ADDED_COLUMNS[:-1]), b.data_parallel_rank)
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
) -> Configured:
    """What to save: the backend overlay, the drains and the pairs (one per draft), now."""
    diff = overlay(config, current)
    unique = tuple({p.draft: p for p in pairs}.values())
    return Configured(diff.added, diff.removed, {str(k): v for k, v in drained.items()}, unique)
