"""AdminService: fleet management for operators (the `baton` CLI). Translation only.

Tenants' keys: a plaintext key exists only in the answer to AddTenant or AddTenantKey; the
registry keeps its digest, and events and logs name it by key id."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

from baton import wire
from baton.tenancy import KEY_PREFIX, digest
from baton.v1 import admin_pb2, admin_pb2_grpc
from control.api import convert
from control.api.admin_adapters import AdapterAdmin, AdapterOps
from control.api.admin_prices import PriceAdmin
from control.api.admin_usage import StoredDays, UsageAdmin
from control.api.errors import Context, within
from control.api.writes import write
from control.audit.log import Event, EventQuery
from control.audit.payloads import Admin, Payload
from control.backend_spec import make_backend
from control.exceptions import FactsError, PairRefused
from control.routing.router import Router
from control.signals.facts import ReadFacts

VERSION = "0.1.0"


def new_key() -> str:
    """A tenant's API key: 256 random bits. Shown once, in the answer that made it."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


class AdminServicer(AdapterAdmin, UsageAdmin, PriceAdmin, admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        router: Router,
        read_facts: ReadFacts,
        *,
        started: float | None = None,
        on_changed: Callable[[], Awaitable[None]] | None = None,
        status: Callable[[admin_pb2.GetStatusResponse], Awaitable[None]] | None = None,
        adapters: AdapterOps | None = None,
        stored_days: StoredDays | None = None,
    ) -> None:
        # Awaited after each change an operator made (backends, drains, pairs, tenants, prices):
        # control persists its configuration there, off the routing path. A replica writes
        # it to etcd; if that fails (StoreError) the change was undone, and the caller is
        # told so.
        self._changed = on_changed
        # Writes one at a time: a change and its saving are one step, so a write undone
        # never takes another's change with it.
        self._writes = asyncio.Lock()
        self._status = status  # fills in a replica's part of GetStatus
        self._adapter_ops = adapters  # LoRA loads and unloads (control/server/adapters.py)
        self._stored_days = stored_days  # use per day as fleet.db kept it
        self._read_facts = read_facts
        self._router = router
        self._registry = router.registry
        self._pairs = router.pairs
        self._started = started if started is not None else time.monotonic()

    async def _commit(self) -> None:
        if self._changed is not None:
            await self._changed()  # a StoreError undid the change; _write answers it

    async def _tenants_changed(self, event: Payload) -> None:
        await self._commit()
        self._registry.events.record(event)

    async def ListBackends(
        self, request: admin_pb2.ListBackendsRequest, context: Context
    ) -> admin_pb2.ListBackendsResponse:
        snap = self._registry.snapshot
        load = self._registry.in_flight()
        rows = [wire.status_to_pb(b, load) for b in snap.backends]
        now = self._router.now()
        for row in rows:
            reading = self._registry.engine_load(row.backend.id)
            if reading is not None:
                row.engine_read = True
                row.engine_running, row.engine_waiting = reading.running, reading.waiting
                row.engine_kv_usage = -1.0 if reading.kv_usage is None else reading.kv_usage
                row.engine_age_s = max(now - reading.read_at, 0.0)
        kv = {str(b): convert.kv_status_to_pb(s) for b, s in self._registry.kv_status().items()}
        return admin_pb2.ListBackendsResponse(
            backends=rows, snapshot_version=snap.version, kv_index=kv
        )

    @write
    async def AddBackend(
        self, request: admin_pb2.AddBackendRequest, context: Context
    ) -> admin_pb2.AddBackendResponse:
        backend = make_backend(**convert.backend_fields_from_pb(request.backend))
        status = self._registry.add(backend)
        await self._commit()
        return admin_pb2.AddBackendResponse(
            backend=wire.status_to_pb(status, self._registry.in_flight()),
            snapshot_version=self._registry.snapshot.version,
        )

    @write
    async def RemoveBackend(
        self, request: admin_pb2.RemoveBackendRequest, context: Context
    ) -> admin_pb2.RemoveBackendResponse:
        self._registry.remove(request.id)
        await self._commit()
        return admin_pb2.RemoveBackendResponse(snapshot_version=self._registry.snapshot.version)

    @write
    async def DrainBackend(
        self, request: admin_pb2.DrainBackendRequest, context: Context
    ) -> admin_pb2.DrainBackendResponse:
        status = self._registry.drain(request.id, migrate=request.migrate)
        await self._commit()
        return admin_pb2.DrainBackendResponse(
            backend=wire.status_to_pb(status, self._registry.in_flight()),
            snapshot_version=self._registry.snapshot.version,
        )

    @write
    async def UndrainBackend(
        self, request: admin_pb2.UndrainBackendRequest, context: Context
    ) -> admin_pb2.UndrainBackendResponse:
        status = self._registry.undrain(request.id)
        await self._commit()
        return admin_pb2.UndrainBackendResponse(
            backend=wire.status_to_pb(status, self._registry.in_flight()),
            snapshot_version=self._registry.snapshot.version,
        )

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: Context
    ) -> admin_pb2.GetStatusResponse:
        snap = self._registry.snapshot
        total: Counter[str] = Counter()
        healthy: Counter[str] = Counter()
        for b in snap.backends:
            total[b.backend.model] += 1
            healthy[b.backend.model] += b.routable
        resp = admin_pb2.GetStatusResponse(
            version=VERSION,
            snapshot_version=snap.version,
            routing_policy=self._router.policy.name,
            models=[
                admin_pb2.ModelStatus(model=m, backends=total[m], healthy=healthy[m])
                for m in sorted(total)
            ],
            uptime_seconds=time.monotonic() - self._started,
            in_flight=self._registry.in_flight_total(),
        )
        if self._status is not None:
            await self._status(resp)
        return resp

    async def ListEvents(
        self, request: admin_pb2.ListEventsRequest, context: Context
    ) -> admin_pb2.ListEventsResponse:
        events = self._registry.events.query(convert.event_query_from_pb(request))
        return admin_pb2.ListEventsResponse(events=[convert.event_to_pb(e) for e in events])

    async def ListPins(
        self, request: admin_pb2.ListPinsRequest, context: Context
    ) -> admin_pb2.ListPinsResponse:
        placed = self._registry.placement  # each kind most recently used first
        infos: list[admin_pb2.PinInfo] = []
        if request.kind in ("", "response"):
            infos += [convert.owned_to_pb(o) for o in reversed(list(placed.owners))]
        if request.kind in ("", "session"):
            infos += [convert.session_to_pb(p) for p in reversed(list(placed.sessions))]
        if request.kind in ("", "prefix"):
            infos += [convert.pin_to_pb(p) for p in reversed(list(placed.pins))]
        chosen = [p for p in infos if not request.backend_id or p.backend_id == request.backend_id]
        return admin_pb2.ListPinsResponse(pins=chosen[: request.limit or 100], total=len(chosen))

    async def ClearPins(
        self, request: admin_pb2.ClearPinsRequest, context: Context
    ) -> admin_pb2.ClearPinsResponse:
        # Prefix pins only: they are hints. An ownership pin is a fact about where a stored
        # response lives; forgetting it would only turn its follow-ups into refusals.
        cleared = self._registry.placement.clear_pins(request.backend_id)
        self._registry.events.record(
            Admin(action="clear-pins", cleared=cleared), backend_id=request.backend_id
        )
        return admin_pb2.ClearPinsResponse(cleared=cleared)

    @write
    async def BindPair(
        self, request: admin_pb2.BindPairRequest, context: Context
    ) -> admin_pb2.BindPairResponse:
        reg = self._registry
        draft = reg.backend(request.draft_backend_id)
        target = reg.backend(request.target_backend_id)
        # Fail closed: the facts come from the two backends now, or there is no pair.
        try:
            draft_facts, target_facts = await asyncio.gather(
                self._read_facts(draft, within(context)),
                self._read_facts(target, within(context)),
            )
        except FactsError as exc:
            raise PairRefused(str(exc)) from exc
        pair = self._pairs.bind_pair(
            draft.id, target.id, request.num_draft_tokens, draft_facts, target_facts
        )
        await self._commit()
        return admin_pb2.BindPairResponse(pair=convert.pair_to_pb(pair, self._pairs.baseline(pair)))

    @write
    async def UnbindPair(
        self, request: admin_pb2.UnbindPairRequest, context: Context
    ) -> admin_pb2.UnbindPairResponse:
        self._pairs.unbind_pair(request.id)
        await self._commit()
        return admin_pb2.UnbindPairResponse()

    async def ListPairs(
        self, request: admin_pb2.ListPairsRequest, context: Context
    ) -> admin_pb2.ListPairsResponse:
        pairs = self._pairs
        return admin_pb2.ListPairsResponse(
            pairs=[convert.pair_to_pb(p, pairs.baseline(p)) for p in pairs]
        )

    @write
    async def AddTenant(
        self, request: admin_pb2.AddTenantRequest, context: Context
    ) -> admin_pb2.AddTenantResponse:
        wanted = convert.configured_tenant_from_pb(request.tenant)
        key = new_key()
        tenant = self._registry.tenants.add(wanted, digest(key), self._router.now())
        event = convert.tenant_event("add-tenant", tenant, tenant.keys[-1].key_id)
        await self._tenants_changed(event)
        return admin_pb2.AddTenantResponse(tenant=wire.tenant_to_pb(tenant), key=key)

    @write
    async def UpdateTenant(
        self, request: admin_pb2.UpdateTenantRequest, context: Context
    ) -> admin_pb2.UpdateTenantResponse:
        t = convert.configured_tenant_from_pb(request.tenant, update=True)
        tenant = self._registry.tenants.update(t.id, t.priority, t.weight, t.limits, t.budgets)
        await self._tenants_changed(convert.tenant_event("update-tenant", tenant))
        return admin_pb2.UpdateTenantResponse(tenant=wire.tenant_to_pb(tenant))

    @write
    async def RemoveTenant(
        self, request: admin_pb2.RemoveTenantRequest, context: Context
    ) -> admin_pb2.RemoveTenantResponse:
        tenant = self._registry.tenants.get(request.id)
        self._registry.tenants.remove(request.id)
        await self._tenants_changed(convert.tenant_event("remove-tenant", tenant))
        return admin_pb2.RemoveTenantResponse()

    async def ListTenants(
        self, request: admin_pb2.ListTenantsRequest, context: Context
    ) -> admin_pb2.ListTenantsResponse:
        tenants = self._registry.tenants.all()
        return admin_pb2.ListTenantsResponse(tenants=[wire.tenant_to_pb(t) for t in tenants])

    @write
    async def AddTenantKey(
        self, request: admin_pb2.AddTenantKeyRequest, context: Context
    ) -> admin_pb2.AddTenantKeyResponse:
        key = new_key()
        tenant = self._registry.tenants.add_key(request.tenant_id, digest(key), self._router.now())
        event = convert.tenant_event("add-tenant-key", tenant, tenant.keys[-1].key_id)
        await self._tenants_changed(event)
        return admin_pb2.AddTenantKeyResponse(tenant=wire.tenant_to_pb(tenant), key=key)

    @write
    async def RevokeTenantKey(
        self, request: admin_pb2.RevokeTenantKeyRequest, context: Context
    ) -> admin_pb2.RevokeTenantKeyResponse:
        tenant = self._registry.tenants.revoke_key(request.tenant_id, request.key_id)
        event = convert.tenant_event("revoke-tenant-key", tenant, request.key_id)
        await self._tenants_changed(event)
        return admin_pb2.RevokeTenantKeyResponse(tenant=wire.tenant_to_pb(tenant))

    async def TenantUsage(
        self, request: admin_pb2.TenantUsageRequest, context: Context
    ) -> admin_pb2.TenantUsageResponse:
        since = request.since.ToNanoseconds() / 1e9 if request.HasField("since") else None
        reg = self._registry
        usage = reg.tenants.usage(since, now=self._router.now())
        return admin_pb2.TenantUsageResponse(usage=[convert.usage_to_pb(u) for u in usage],
                                             unpriced_models=convert.unpriced(reg))  # fmt: skip

    async def WatchEvents(
        self, request: admin_pb2.WatchEventsRequest, context: Context
    ) -> AsyncIterator[admin_pb2.WatchEventsResponse]:
        query = EventQuery(request.kind, request.request_id, request.backend_id)
        # Bounded: a watcher that cannot keep up loses events (counted), control never waits.
        queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=10_000)
        dropped = 0

        def on_event(event: Event) -> None:
            nonlocal dropped
            if query.matches(event):
                try:
                    queue.put_nowait(event)
                except asyncio.QueueFull:
                    dropped += 1

        unsubscribe = self._registry.events.subscribe(on_event)
        try:
            while True:
                event = await queue.get()
                yield admin_pb2.WatchEventsResponse(event=convert.event_to_pb(event))
        finally:
            unsubscribe()
