"""AdminService's ExportUsage (`baton usage export`, `baton tenants usage --by`): use per
tenant, model and UTC day, as fleet.db kept it (or etcd, with control replicas) with what
control holds not written yet over it (baton/usage_days.py). Translation only; pages go in
(day, tenant, model) order."""

from __future__ import annotations

import json
from typing import Protocol

from baton.usage_days import DayRow, Key, day_of, merge
from baton.v1 import admin_pb2
from baton.wire_money import decimal
from control.api.errors import Context, map_errors
from control.exceptions import ConfigError
from control.fleet.registry import Registry
from control.routing.router import Router

PAGE = 5000  # rows an answer carries unless asked for fewer (~100 bytes each)
PAGE_MAX = 50_000


class StoredDays(Protocol):
    """Where the rows written before are read: fleet.db (control/server/spend_flush.py), or
    etcd for a replica (control/replicas/usage.py)."""

    async def stored_days(
        self, first: str, last: str, after: Key | None, limit: int
    ) -> list[DayRow]: ...


class UsageAdmin:
    """Mixed into AdminServicer, which sets `_registry`, `_router` and `_stored_days` (None:
    no --data-dir and no replicas, only what memory holds)."""

    _registry: Registry
    _router: Router
    _stored_days: StoredDays | None

    @map_errors
    async def ExportUsage(
        self, request: admin_pb2.ExportUsageRequest, context: Context
    ) -> admin_pb2.ExportUsageResponse:
        first = day_of(request.since.ToSeconds()) if request.HasField("since") else ""
        # `until` is exclusive: a day that starts at it is not in.
        if request.HasField("until"):
            last = day_of((request.until.ToNanoseconds() - 1) // 10**9)
        else:
            last = day_of(self._router.now())
        after = _token(request.page_token)
        size = min(request.page_size or PAGE, PAGE_MAX)
        stored: list[DayRow] = []
        if self._stored_days is not None:
            # Read before memory: a row written meanwhile is still held, and memory wins.
            stored = await self._stored_days.stored_days(first or "0000", last, after, size)
        held = [r for r in self._registry.tenants.days.rows(first, last)
                if after is None or r.key > after]  # fmt: skip
        rows = merge(stored, held)[:size]
        token = json.dumps(list(rows[-1].key)) if len(rows) == size else ""
        return admin_pb2.ExportUsageResponse(rows=[_to_pb(r) for r in rows],
                                             next_page_token=token)  # fmt: skip


def _token(text: str) -> Key | None:
    if not text:
        return None
    try:
        day, tenant, model = json.loads(text)
    except (ValueError, TypeError):
        raise ConfigError(f"page_token {text!r} is not one this call gave") from None
    return (str(day), str(tenant), str(model))


def _to_pb(r: DayRow) -> admin_pb2.UsageDay:
    return admin_pb2.UsageDay(
        tenant_id=r.tenant_id, model=r.model, day=r.day, requests=r.requests,
        prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
        completion_tokens=r.completion_tokens, cost=decimal(r.cost),
    )  # fmt: skip
