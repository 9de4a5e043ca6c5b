"""The operator's configuration and the audit log's low-rate events, kept in etcd under one
key prefix (`--store etcd://...`, `--store-prefix`):

    PREFIX/config          the run-time overlay (control/fleet/db.py's Configured) as JSON
    PREFIX/leader          the leading replica (control/replicas/election.py)
    PREFIX/replicas/ID     each live replica's address, on its lease
    PREFIX/events/KEY      failover, retry, health, admin, pair, KV and tenant events
    PREFIX/owners/ID       which backend stores each Responses API response, on an hourly
                           lease that outlives the owner TTL, so etcd itself forgets them

Writes are optimistic on revisions and fenced by the term: a configuration write succeeds
only if the config key is still at the revision this replica last read or wrote, and the
leader key is still the one this replica created. So two admins never silently overwrite
each other, and a deposed leader writes nothing.

Routing decisions are not written here (one per request): each replica keeps its own, in its
own data dir when it has one."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from baton.model import Backend
from control.audit.log import Event
from control.backend_spec import make_backend
from control.exceptions import ConfigError, NotLeader, StoreConflict
from control.fleet.db import BACKEND_COLUMNS, Configured, tenant_from_row, tenant_row
from control.fleet.prices import price_from_row, price_row
from control.replicas import etcd
from control.replicas.etcd import Etcd
from control.settings import PairSpec

log = logging.getLogger("baton.control.replicas")

FORMAT = 1
EVENTS_KEPT = 100_000  # the newest events kept in etcd; older ones are trimmed
TRIM_EVERY = 200  # flushes between trims
PAGE = 2_000  # events parsed between looks at the loop


def encode(c: Configured) -> bytes:
    def backend(b: Backend) -> dict[str, Any]:
        row = {col: getattr(b, col) for col in BACKEND_COLUMNS}
        return {k: (v.value if hasattr(v, "value") else v) for k, v in row.items()}

    return orjson.dumps(
        {
            "format": FORMAT,
            "added": [backend(b) for b in c.added],
            "removed": sorted(c.removed),
            "drained": dict(sorted(c.drained.items())),
            "pairs": [[p.draft, p.target, p.num_draft_tokens] for p in c.pairs],
            "tenants": [tenant_row(t) for t in c.tenants],
            "tenants_removed": sorted(c.tenants_removed),
            "prices": [price_row(m, p) for m, p in sorted(c.prices.items())],
            "prices_unset": sorted(c.prices_unset),
        }
    )


def decode(raw: bytes) -> Configured:
    """What `encode` wrote; anything else is a ConfigError (control refuses to start on it
    rather than come up without the operator's fleet)."""
    try:
        d = json.loads(raw)
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, this Baton reads {FORMAT}")
        return Configured(
            added=tuple(make_backend(**{k: b[k] for k in BACKEND_COLUMNS}) for b in d["added"]),
            removed=frozenset(map(str, d["removed"])),
            drained={str(k): bool(v) for k, v in d["drained"].items()},
            pairs=tuple(PairSpec(str(a), str(b), int(k)) for a, b, k in d["pairs"]),
            tenants=tuple(tenant_from_row(*row) for row in d["tenants"]),
            tenants_removed=frozenset(map(str, d["tenants_removed"])),
            # Absent in what a Baton before run-time prices wrote: none set, none unset.
            prices={row[0]: price_from_row(*row) for row in d.get("prices", [])},
            prices_unset=frozenset(map(str, d.get("prices_unset", []))),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"the configuration in etcd is unreadable ({exc})") from None


@dataclass(frozen=True, slots=True)
class Owner:
    """A stored response's owner, as etcd keeps it."""

    key: str
    backend_id: str
    model: str
    at: float

    def row(self) -> tuple[str, str, float]:
        return (self.backend_id, self.model, self.at)


def _event_key(prefix: bytes, replica: str, e: Event) -> bytes:
    # Time first, so keys sort as events happened, across replicas.
    return prefix + f"/events/{int(e.time * 1e9):020d}/{replica}/{e.seq}".encode()


class ReplicaStore:
    def __init__(self, client: Etcd, prefix: str) -> None:
        self.etcd = client
        self.prefix = prefix.rstrip("/").encode()
        self.config_key = self.prefix + b"/config"
        self.leader_key = self.prefix + b"/leader"
        self.replicas_prefix = self.prefix + b"/replicas/"
        self.events_prefix = self.prefix + b"/events/"
        self.owners_prefix = self.prefix + b"/owners/"
        # The config key's revision as this replica last read or wrote it (0: absent).
        self.revision = 0
        self._flushes = 0

    @property
    def url(self) -> str:
        return self.etcd.url

    async def load(self) -> tuple[Configured, int]:
        """The configuration now and the store's revision then."""
        kv, revision = await self.etcd.get(self.config_key)
        if kv is None:
            self.revision = 0
            return Configured(), revision
        configured = decode(kv.value)
        self.revision = kv.mod_revision
        return configured, revision

    async def save(self, configured: Configured, term: int) -> None:
        """Writes the configuration if this replica still leads in `term` and nobody wrote
        it since this replica last read or wrote it."""
        ok, resp = await self.etcd.txn(
            [
                etcd.compare_create(self.leader_key, term),
                etcd.compare_mod(self.config_key, self.revision),
            ],
            [etcd.put(self.config_key, encode(configured))],
            [etcd.get(self.leader_key), etcd.get(self.config_key)],
        )
        if ok:
            self.revision = resp.header.revision
            return
        leader = resp.responses[0].response_range.kvs
        if not leader or leader[0].create_revision != term:
            raise NotLeader("this replica no longer leads: the change was not written")
        config = resp.responses[1].response_range.kvs
        now = config[0].mod_revision if config else 0
        raise StoreConflict(
            f"the configuration in etcd changed (revision {now}, this replica read "
            f"{self.revision}): the change was not written; try again"
        )

    async def append_events(self, replica: str, events: list[Event], term: int) -> bool:
        """Writes the events if this replica still leads in `term` (False: it does not)."""
        puts = [
            etcd.put(_event_key(self.prefix, replica, e), orjson.dumps(e.to_json())) for e in events
        ]
        ok, _ = await self.etcd.txn([etcd.compare_create(self.leader_key, term)], puts)
        self._flushes += 1
        if ok and self._flushes % TRIM_EVERY == 0:
            await self._trim()
        return ok

    async def _trim(self) -> None:
        """The oldest events past EVENTS_KEPT go (keys only are read: events sort by time)."""
        extra = await self.etcd.count_prefix(self.events_prefix) - EVENTS_KEPT
        if extra > 0:
            oldest = await self.etcd.keys_prefix(self.events_prefix, extra)
            await self.etcd.delete_range(self.events_prefix, oldest[-1] + b"\0")

    async def write_owners(self, changes: list[Owner | str], lease: int, term: int) -> bool:
        """Each change an owner recorded (on `lease`) or, a plain key, released; if this
        replica still leads in `term` (False: it does not)."""
        ops = [
            etcd.delete(self.owners_prefix + c.encode()) if isinstance(c, str)
            else etcd.put(self.owners_prefix + c.key.encode(), orjson.dumps(c.row()), lease)
            for c in changes
        ]  # fmt: skip
        ok, _ = await self.etcd.txn([etcd.compare_create(self.leader_key, term)], ops)
        return ok

    async def load_owners(self) -> list[Owner]:
        kvs, _ = await self.etcd.get_prefix(self.owners_prefix)
        out = []
        for i, kv in enumerate(kvs):
            if i % PAGE == PAGE - 1:
                await asyncio.sleep(0)
            try:
                bid, model, at = orjson.loads(kv.value)
                out.append(Owner(kv.key[len(self.owners_prefix) :].decode(), bid, model, at))
            except (orjson.JSONDecodeError, ValueError, TypeError):
                log.warning("owner %s in etcd is unreadable: skipped", kv.key[:200])
        return out

    async def load_events(self, limit: int = EVENTS_KEPT) -> list[Event]:
        """The newest `limit` events, oldest first. Parsed a page at a time, letting the
        loop run between pages: a new leader reads them while it routes."""
        kvs, _ = await self.etcd.get_prefix(self.events_prefix, limit=limit)
        out = []
        for i, kv in enumerate(kvs):
            if i % PAGE == PAGE - 1:
                await asyncio.sleep(0)
            try:
                raw = orjson.loads(kv.value)
                out.append(Event.from_json(raw))
            except (orjson.JSONDecodeError, KeyError, ValueError, TypeError):
                log.warning(
                    "event %s in etcd is unreadable: skipped", kv.key.decode(errors="replace")
                )
        return out
