"""AdminService's price calls (`baton prices list|set|unset`). Translation only: the price
table is the tenant book's (control/fleet/tenants.py), which publishes each change in the next
snapshot, so shims price with it too; what is kept of it (fleet.db, or etcd with replicas)
is control/fleet/prices.py's overlay, written by the servicer's commit."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from baton import wire_money
from baton.pricing import PRICE_FIELDS, Price, PriceTable
from baton.v1 import admin_pb2, fleet_pb2
from control.api import convert
from control.api.errors import Context, map_errors
from control.api.writes import write
from control.audit.payloads import Admin
from control.exceptions import ConfigError, PriceNotFound
from control.fleet.registry import Registry


def price_from_pb(model: str, pb: fleet_pb2.Price) -> Price:
    """An operator's price; a ConfigError (INVALID_ARGUMENT) naming the field at fault."""
    if not model or model != model.strip():
        raise ConfigError(f"model: a price is for a model name, not {model!r}")
    for name in ("input", "output"):
        if not getattr(pb, name).strip():
            raise ConfigError(f"{name}: a price per million tokens is required")
    try:
        return Price.per_million(pb.input, pb.output, pb.cached_input or None)
    except ValueError as exc:  # names the field: "input must not be negative ('-1')"
        raise ConfigError(f"price of {model!r}: {exc}") from None


def said(p: Price) -> str:
    """The price as the audit event says it: "input=3 cached_input=0.3 output=15"."""
    written = wire_money.prices_to_pb(PriceTable({"": p}))[""]
    return " ".join(f"{name}={getattr(written, name)}" for name in PRICE_FIELDS)


class PriceAdmin:
    """Mixed into AdminServicer, which sets `_registry`, `_writes` and `_commit`."""

    _registry: Registry
    _writes: asyncio.Lock
    _commit: Callable[[], Awaitable[None]]

    @map_errors
    async def ListPrices(
        self, request: admin_pb2.ListPricesRequest, context: Context
    ) -> admin_pb2.ListPricesResponse:
        table = self._registry.tenants.prices
        written = wire_money.prices_to_pb(table)
        rows = [admin_pb2.ModelPrice(model=m, price=written[m]) for m in sorted(written)]
        unpriced = convert.unpriced(self._registry)
        return admin_pb2.ListPricesResponse(prices=rows, unpriced_models=unpriced)

    @write
    async def SetPrice(
        self, request: admin_pb2.SetPriceRequest, context: Context
    ) -> admin_pb2.SetPriceResponse:
        price = price_from_pb(request.model, request.price)  # checked before anything changes
        book = self._registry.tenants
        book.set_prices(book.prices.with_price(request.model, price))
        await self._commit()  # a StoreError undid it (a replica's reconcile)
        version = self._registry.snapshot.version
        self._registry.events.record(Admin(action="set-price", model=request.model,
                                           price=said(price)))  # fmt: skip
        row = wire_money.prices_to_pb(PriceTable({request.model: price}))[request.model]
        return admin_pb2.SetPriceResponse(
            price=admin_pb2.ModelPrice(model=request.model, price=row), snapshot_version=version
        )

    @write
    async def UnsetPrice(
        self, request: admin_pb2.UnsetPriceRequest, context: Context
    ) -> admin_pb2.UnsetPriceResponse:
        model = request.model
        if not model:
            raise ConfigError("model: a price is for a model name, not ''")
        book = self._registry.tenants
        if not book.prices.priced(model):
            raise PriceNotFound(f"{model!r} has no price (it costs 0)")
        book.set_prices(book.prices.with_price(model, None))
        await self._commit()
        version = self._registry.snapshot.version
        self._registry.events.record(Admin(action="unset-price", model=model))
        return admin_pb2.UnsetPriceResponse(snapshot_version=version)
