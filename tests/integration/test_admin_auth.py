"""The admin bearer token on every AdminService RPC, through real processes: with no token or a
wrong one each call is UNAUTHENTICATED and changes nothing; with the right one calls work."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from baton.v1 import admin_pb2, admin_pb2_grpc, fleet_pb2
from tests.integration.harness import MODEL, wait_until
from tests.integration.tokenfleet import token_fleet

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-admin-token"
RPC_TIMEOUT = 5.0
Metadata = tuple[tuple[str, str], ...]
RIGHT: Metadata = (("authorization", f"Bearer {TOKEN}"),)
# Each way of not holding the token: none at all, a guess, the token without its scheme,
# a prefix of it, and the right token after a wrong scheme.
BAD: dict[str, Metadata] = {
    "none": (),
    "wrong": (("authorization", "Bearer guess"),),
    "no-scheme": (("authorization", TOKEN),),
    "prefix": (("authorization", f"Bearer {TOKEN[:-1]}"),),
    "basic": (("authorization", f"Basic {TOKEN}"),),
}


@dataclass
class AuthFleet:
    """Control (with a token) over serve sims t0, t1 and a draft d; d is paired with t0, t1 is
    drained, and a chat turn through the shim left at least one pin."""

    stub: admin_pb2_grpc.AdminServiceStub
    draft_url: str
    pair_id: str


@pytest.fixture(scope="module")
def auth_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthFleet]:
    # t1 drained, so every pin is on t0; the shim has a token of its own.
    path: Path = tmp_path_factory.mktemp("auth")
    with token_fleet(path, TOKEN, "the-shim-token", drain_t1=True) as f:
        stub = admin_pb2_grpc.AdminServiceStub(f.channel)
        yield AuthFleet(stub, f.draft_url, f.pair_id)


def state(stub: admin_pb2_grpc.AdminServiceStub) -> dict[str, Any]:
    """Everything an admin call could change, read with the right token."""
    kw: dict[str, Any] = {"metadata": RIGHT, "timeout": RPC_TIMEOUT}
    backends = stub.ListBackends(admin_pb2.ListBackendsRequest(), **kw)
    pins = stub.ListPins(admin_pb2.ListPinsRequest(limit=1000), **kw)
    pairs = stub.ListPairs(admin_pb2.ListPairsRequest(), **kw)
    tenants = stub.ListTenants(admin_pb2.ListTenantsRequest(), **kw)
    adapters = stub.ListAdapters(admin_pb2.ListAdaptersRequest(), **kw)
    prices = stub.ListPrices(admin_pb2.ListPricesRequest(), **kw)
    audit = [
        (e.seq, e.kind, e.backend_id, e.json)
        for kind in ("admin", "pair")
        for e in stub.ListEvents(admin_pb2.ListEventsRequest(kind=kind), **kw).events
    ]
    return {
        "snapshot_version": backends.snapshot_version,
        "backends": sorted(
            (b.backend.SerializeToString(deterministic=True), b.state, b.migrating)
            for b in backends.backends
        ),
        "pins": (pins.total, sorted((p.prefix, p.backend_id, p.depth) for p in pins.pins)),
        "pairs": sorted(
            (p.id, p.draft_backend_id, p.target_backend_id, p.num_draft_tokens, p.state)
            for p in pairs.pairs
        ),
        "audit": audit,
        "tenants": sorted(t.SerializeToString(deterministic=True) for t in tenants.tenants),
        "adapters": sorted(a.SerializeToString(deterministic=True) for a in adapters.adapters),
        "prices": prices.SerializeToString(deterministic=True),
    }


Call = Callable[[AuthFleet, Metadata], object]


def _unary(method: str, request: Callable[[AuthFleet], object]) -> Call:
    def call(f: AuthFleet, md: Metadata) -> object:
        return getattr(f.stub, method)(request(f), metadata=md, timeout=RPC_TIMEOUT)

    return call


def _watch(f: AuthFleet, md: Metadata) -> object:
    # Bounded: if the stream were let through, no event comes and the deadline ends it.
    stream = f.stub.WatchEvents(admin_pb2.WatchEventsRequest(), metadata=md, timeout=RPC_TIMEOUT)
    return next(iter(stream))


# Every AdminService RPC, each with a request that the right token would make do something
# (or at least be accepted): test_every_rpc_is_covered keeps this in step with the proto.
CALLS: dict[str, Call] = {
    "AddBackend": _unary(
        "AddBackend",
        lambda f: admin_pb2.AddBackendRequest(
            backend=fleet_pb2.Backend(
                id="intruder", url=f.draft_url, model=MODEL, kind=fleet_pb2.BACKEND_KIND_VLLM
            )
        ),
    ),
    "RemoveBackend": _unary("RemoveBackend", lambda f: admin_pb2.RemoveBackendRequest(id="t0")),
    "DrainBackend": _unary("DrainBackend", lambda f: admin_pb2.DrainBackendRequest(id="t0")),
    "DrainBackend(migrate)": _unary(
        "DrainBackend", lambda f: admin_pb2.DrainBackendRequest(id="t0", migrate=True)
    ),
    "UndrainBackend": _unary("UndrainBackend", lambda f: admin_pb2.UndrainBackendRequest(id="t1")),
    "ClearPins": _unary("ClearPins", lambda f: admin_pb2.ClearPinsRequest()),
    "ClearPins(backend)": _unary(
        "ClearPins", lambda f: admin_pb2.ClearPinsRequest(backend_id="t0")
    ),
    "BindPair": _unary(
        "BindPair",
        lambda f: admin_pb2.BindPairRequest(draft_backend_id="d", target_backend_id="t1"),
    ),
    "UnbindPair": _unary("UnbindPair", lambda f: admin_pb2.UnbindPairRequest(id=f.pair_id)),
    "WatchEvents": _watch,
    # The reads: they change nothing anyway, but must not leak the fleet either.
    "ListBackends": _unary("ListBackends", lambda f: admin_pb2.ListBackendsRequest()),
    "GetStatus": _unary("GetStatus", lambda f: admin_pb2.GetStatusRequest()),
    "ListEvents": _unary("ListEvents", lambda f: admin_pb2.ListEventsRequest()),
    "ListPins": _unary("ListPins", lambda f: admin_pb2.ListPinsRequest()),
    "ListPairs": _unary("ListPairs", lambda f: admin_pb2.ListPairsRequest()),
    # Tenants (the fleet has none: with the token, the ones naming "t" answer NOT_FOUND).
    "AddTenant": _unary(
        "AddTenant", lambda f: admin_pb2.AddTenantRequest(tenant=fleet_pb2.Tenant(id="intruder"))
    ),
    "UpdateTenant": _unary(
        "UpdateTenant",
        lambda f: admin_pb2.UpdateTenantRequest(
            tenant=fleet_pb2.Tenant(id="t", priority=fleet_pb2.PRIORITY_CLASS_INTERACTIVE, weight=9)
        ),
    ),
    "RemoveTenant": _unary("RemoveTenant", lambda f: admin_pb2.RemoveTenantRequest(id="t")),
    "ListTenants": _unary("ListTenants", lambda f: admin_pb2.ListTenantsRequest()),
    "AddTenantKey": _unary("AddTenantKey", lambda f: admin_pb2.AddTenantKeyRequest(tenant_id="t")),
    "RevokeTenantKey": _unary(
        "RevokeTenantKey",
        lambda f: admin_pb2.RevokeTenantKeyRequest(tenant_id="t", key_id="000000000000"),
    ),
    "TenantUsage": _unary("TenantUsage", lambda f: admin_pb2.TenantUsageRequest()),
    "ExportUsage": _unary("ExportUsage", lambda f: admin_pb2.ExportUsageRequest()),
    # LoRA adapters: a load that would declare one, an unload, and the list.
    "LoadAdapter": _unary(
        "LoadAdapter",
        lambda f: admin_pb2.LoadAdapterRequest(name="intruder-lora", base=MODEL,
                                               source="/tmp/none"),  # fmt: skip
    ),
    "UnloadAdapter": _unary(
        "UnloadAdapter", lambda f: admin_pb2.UnloadAdapterRequest(name="intruder-lora")
    ),
    "ListAdapters": _unary("ListAdapters", lambda f: admin_pb2.ListAdaptersRequest()),
    # Prices (the fleet has none: with the token, the unset answers NOT_FOUND).
    "SetPrice": _unary(
        "SetPrice",
        lambda f: admin_pb2.SetPriceRequest(
            model=MODEL, price=fleet_pb2.Price(input="1", output="2")
        ),
    ),
    "UnsetPrice": _unary("UnsetPrice", lambda f: admin_pb2.UnsetPriceRequest(model=MODEL)),
    "ListPrices": _unary("ListPrices", lambda f: admin_pb2.ListPricesRequest()),
}


def test_every_rpc_is_covered() -> None:
    service = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]
    assert {name.split("(")[0] for name in CALLS} == set(service.methods_by_name)


@pytest.mark.parametrize("who", sorted(BAD))
@pytest.mark.parametrize("rpc", list(CALLS))
def test_without_the_token_every_rpc_is_refused_and_changes_nothing(
    auth_fleet: AuthFleet, rpc: str, who: str
) -> None:
    before = state(auth_fleet.stub)
    assert before["pins"][0] > 0 and before["pairs"]  # something there to clear or unbind
    with pytest.raises(grpc.RpcError) as err:
        CALLS[rpc](auth_fleet, BAD[who])
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, err.value
    assert "admin token" in (err.value.details() or "")
    assert state(auth_fleet.stub) == before


def test_with_the_token_mutations_and_the_watch_work(auth_fleet: AuthFleet) -> None:
    """The same calls with the right token do change the fleet (so the refusals above are
    about the token); everything changed here is put back, so test order does not matter."""
    stub = auth_fleet.stub
    kw: dict[str, Any] = {"metadata": RIGHT, "timeout": RPC_TIMEOUT}
    # A watch with the token sees the admin events that follow it.
    seen: list[admin_pb2.WatchEventsResponse] = []
    stream = stub.WatchEvents(
        admin_pb2.WatchEventsRequest(kind="admin"), metadata=RIGHT, timeout=30
    )

    def tail() -> None:
        try:
            for resp in stream:
                seen.append(resp)
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=tail, daemon=True)
    reader.start()
    try:
        before = state(stub)
        CALLS["AddBackend"](auth_fleet, RIGHT)
        added = state(stub)
        ids = {
            b.backend.id for b in stub.ListBackends(admin_pb2.ListBackendsRequest(), **kw).backends
        }
        assert "intruder" in ids
        assert added["snapshot_version"] > before["snapshot_version"]
        assert len(added["audit"]) == len(before["audit"]) + 1
        stub.RemoveBackend(admin_pb2.RemoveBackendRequest(id="intruder"), **kw)
        drained = CALLS["DrainBackend"](auth_fleet, RIGHT)
        assert drained.backend.state == fleet_pb2.HEALTH_STATE_DRAINING  # type: ignore[attr-defined]
        stub.UndrainBackend(admin_pb2.UndrainBackendRequest(id="t0"), **kw)
        # The watch subscribes when its handler starts: keep making admin events (a clear of
        # a backend with no pins records one and clears nothing) until one reaches it.
        clear_none = admin_pb2.ClearPinsRequest(backend_id="intruder")
        assert wait_until(
            lambda: stub.ClearPins(clear_none, **kw).cleared == 0 and bool(seen), interval=0.1
        ), "the right token's watch saw no admin event"
        assert json.loads(seen[0].event.json)["kind"] == "admin"
        CALLS["SetPrice"](auth_fleet, RIGHT)
        assert state(stub)["prices"] != before["prices"]
        CALLS["UnsetPrice"](auth_fleet, RIGHT)
        after = state(stub)
        assert after["prices"] == before["prices"]
        assert after["backends"] == before["backends"]
        assert after["pins"] == before["pins"] and after["pairs"] == before["pairs"]
    finally:
        stream.cancel()
        reader.join(timeout=5)
