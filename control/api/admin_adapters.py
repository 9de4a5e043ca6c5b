"""AdminService's LoRA adapter calls (`baton adapters list|load|unload`). Translation only:
what an adapter is and where it is held is the adapter book's (control/fleet/adapter_book.py);
loads and unloads are control/server/adapters.py's, which records their audit events."""

from __future__ import annotations

from typing import Protocol

from baton import wire
from baton.model import Adapter
from baton.v1 import admin_pb2
from control.api.errors import Context, map_errors
from control.exceptions import AdapterNotFound, AdapterRefused, ConfigError
from control.fleet.registry import Registry
from control.routing.adapter_flow import LoadResult
from control.routing.adapters import rank
from control.routing.router import Router


class AdapterOps(Protocol):
    """What the admin calls need of control's adapter service."""

    async def load(self, backend_id: str, adapter: Adapter) -> LoadResult: ...

    async def unload(self, backend_id: str, name: str, *, why: str = ...) -> tuple[bool, str]: ...


class AdapterAdmin:
    """Mixed into AdminServicer, which sets `_registry`, `_router` and `_adapter_ops`."""

    _registry: Registry
    _router: Router
    _adapter_ops: AdapterOps | None

    @map_errors
    async def ListAdapters(
        self, request: admin_pb2.ListAdaptersRequest, context: Context
    ) -> admin_pb2.ListAdaptersResponse:
        book = self._registry.adapters
        declared = {a.name for a in book.declared()}
        loading = book.residency.loads_in_flight()
        now = self._router.now()
        rows = [
            admin_pb2.AdapterRow(
                adapter=wire.adapter_to_pb(a), declared=a.name in declared,
                held_by=book.residency.holders(a.name),
                loading_on=[b for b, n in loading if n == a.name],
                demand_rps=book.demand.rate(a.name, now),
            )
            for a in book.all()
        ]  # fmt: skip
        return admin_pb2.ListAdaptersResponse(adapters=rows)

    @map_errors
    async def LoadAdapter(
        self, request: admin_pb2.LoadAdapterRequest, context: Context
    ) -> admin_pb2.LoadAdapterResponse:
        adapter, new = self._known(request.name, request.base, request.source)
        backend_id = request.backend_id or self._placed(adapter)
        status = self._registry.snapshot.get(backend_id)
        if status is None:
            self._registry.backend(backend_id)  # raises BackendNotFound
        elif status.backend.model != adapter.base or not status.serves_adapters():
            raise AdapterRefused(f"backend {backend_id} serves no adapters of {adapter.base!r} "
                                 f"(its model: {status.backend.model!r}; an adapter engine "
                                 "runs with --enable-lora)")  # fmt: skip
        assert self._adapter_ops is not None
        if new:  # declared only once the call is known to be good: a refusal changes nothing
            self._registry.adapters.declare(adapter)
        done = await self._adapter_ops.load(backend_id, adapter)
        return admin_pb2.LoadAdapterResponse(backend_id=backend_id, ok=done.ok, ms=done.ms,
                                             detail=done.detail, evicted=done.evicted)  # fmt: skip

    @map_errors
    async def UnloadAdapter(
        self, request: admin_pb2.UnloadAdapterRequest, context: Context
    ) -> admin_pb2.UnloadAdapterResponse:
        book = self._registry.adapters
        if book.get(request.name) is None:
            raise AdapterNotFound(f"no adapter named {request.name!r}")
        where = [request.backend_id] if request.backend_id else book.residency.holders(
            request.name)  # fmt: skip
        assert self._adapter_ops is not None
        gone = []
        for backend_id in where:
            self._registry.backend(backend_id)  # raises BackendNotFound
            ok, _ = await self._adapter_ops.unload(backend_id, request.name, why="admin")
            if ok:
                gone.append(backend_id)
        return admin_pb2.UnloadAdapterResponse(unloaded_from=gone)

    def _known(self, name: str, base: str, source: str) -> tuple[Adapter, bool]:
        """The adapter by name, or a new one when a base and source are given (True: new)."""
        if not name:
            raise ConfigError("an adapter's name is required")
        book = self._registry.adapters
        known = book.get(name)
        if known is not None:
            return known, False
        if not (base and source):
            raise AdapterNotFound(f"no adapter named {name!r}: declare it with its base and "
                                  "source (--base, --source), or in [[adapters]]")  # fmt: skip
        if any(s.backend.model == name for s in self._registry.snapshot.backends):
            raise ConfigError(f"{name!r} is a backend's model, not an adapter")
        return Adapter(name, base, source), True

    def _placed(self, adapter: Adapter) -> str:
        """Where placement would load it: the first of its ranking that does not hold it."""
        snap = self._registry.snapshot
        serving = [s.backend.id for s in snap.backends if s.routable and s.serves_adapters()
                   and s.backend.model == adapter.base]  # fmt: skip
        lacking = [b for b in rank(adapter.name, serving)
                   if not self._registry.adapters.residency.holds(b, adapter.name)]  # fmt: skip
        if not lacking:
            why = "every one holds it" if serving else "none is routable"
            raise AdapterRefused(f"no replica of {adapter.base!r} to load {adapter.name!r} "
                                 f"on: {why}")  # fmt: skip
        return lacking[0]
