"""AdminService's refusals through the one table (control/api/errors.py STATUS_FOR): whatever
a write's registry step raises answers the call with its mapped status and message, and
nothing is committed; a commit the store refused carries the baton-store trailer, which the
CLI reads as "the leader answered, ask no other replica" (baton/replicas.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from baton.replicas import STORE_METADATA, from_store
from baton.v1 import admin_pb2, admin_pb2_grpc, fleet_pb2
from control.api.admin import AdminServicer
from control.api.errors import STATUS_FOR
from control.exceptions import PairNotFound, StoreConflict, StoreError, StoreUnavailable

STORE_TRAILER = ((STORE_METADATA, "etcd"),)

# Each write and a request its conversions accept, so that the registry step is reached.
WRITES: dict[str, object] = {
    "AddBackend": admin_pb2.AddBackendRequest(
        backend=fleet_pb2.Backend(id="b", url="http://127.0.0.1:1", model="m")
    ),
    "RemoveBackend": admin_pb2.RemoveBackendRequest(id="b"),
    "DrainBackend": admin_pb2.DrainBackendRequest(id="b"),
    "UndrainBackend": admin_pb2.UndrainBackendRequest(id="b"),
    "BindPair": admin_pb2.BindPairRequest(draft_backend_id="d", target_backend_id="t"),
    "UnbindPair": admin_pb2.UnbindPairRequest(id="d"),
    "AddTenant": admin_pb2.AddTenantRequest(tenant=fleet_pb2.Tenant(id="acme")),
    "UpdateTenant": admin_pb2.UpdateTenantRequest(
        tenant=fleet_pb2.Tenant(id="acme", priority=fleet_pb2.PRIORITY_CLASS_STANDARD, weight=1)
    ),
    "RemoveTenant": admin_pb2.RemoveTenantRequest(id="acme"),
    "AddTenantKey": admin_pb2.AddTenantKeyRequest(tenant_id="acme"),
    "RevokeTenantKey": admin_pb2.RevokeTenantKeyRequest(tenant_id="acme", key_id="k"),
}


class Refusing:
    """A registry (and its pairs and tenants) whose every method raises `exc`."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.tenants = self

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def refuse(*args: object, **kwargs: object) -> Any:
            raise self.exc

        return refuse


class Aborted(Exception):
    pass


class FakeContext:
    """grpc.aio's ServicerContext as the servicer uses it: abort raises."""

    def __init__(self) -> None:
        self.ended: tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None = None

    async def abort(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.ended = (code, details, trailing)
        raise Aborted

    def time_remaining(self) -> float | None:
        return None


class Commits:
    def __init__(self, exc: Exception | None = None) -> None:
        self.exc, self.calls = exc, 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.exc is not None:
            raise self.exc


def servicer(registry: Any, commit: Commits) -> AdminServicer:
    router = SimpleNamespace(registry=registry, pairs=registry, now=lambda: 0.0)

    async def no_facts(*args: object) -> None:
        raise AssertionError("the registry refuses before facts are read")

    return AdminServicer(router, no_facts, on_changed=commit)  # type: ignore[arg-type]


def call(admin: AdminServicer, method: str, context: object) -> Any:
    rpc: Callable[[object, object], Coroutine[Any, Any, Any]] = getattr(admin, method)
    return asyncio.run(rpc(WRITES[method], context))


@pytest.mark.parametrize(("cls", "code"), STATUS_FOR, ids=[c.__name__ for c, _ in STATUS_FOR])
@pytest.mark.parametrize("method", WRITES)
def test_a_write_answers_the_mapped_status_of_what_its_registry_raises(
    method: str, cls: type[Exception], code: grpc.StatusCode
) -> None:
    commit = Commits()
    context = FakeContext()
    with pytest.raises(Aborted):
        call(servicer(Refusing(cls("why it refused")), commit), method, context)
    trailing = STORE_TRAILER if issubclass(cls, StoreError) else ()
    assert context.ended == (code, "why it refused", trailing)
    assert commit.calls == 0  # the handler stopped at the refusal


@pytest.mark.parametrize("method", WRITES)
def test_an_unmapped_exception_propagates(method: str) -> None:
    context = FakeContext()
    with pytest.raises(KeyError):
        call(servicer(Refusing(KeyError("x")), Commits()), method, context)
    assert context.ended is None


async def refused(admin: AdminServicer, method: str) -> grpc.aio.AioRpcError:
    """How a client sees `method` refused by `admin`, served by grpc.aio on 127.0.0.1:0."""
    server = grpc.aio.server()
    admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await getattr(stub, method)(WRITES[method], timeout=5)
            return err.value
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (StoreUnavailable("etcd is away: the change was not made"), grpc.StatusCode.UNAVAILABLE),
        (StoreConflict("the configuration in etcd changed"), grpc.StatusCode.ABORTED),
    ],
)
def test_a_commit_the_store_refused_carries_the_store_trailer(
    exc: Exception, code: grpc.StatusCode
) -> None:
    commit = Commits(exc)
    admin = servicer(SimpleNamespace(remove=lambda backend_id: None), commit)
    err = asyncio.run(refused(admin, "RemoveBackend"))
    assert (err.code(), err.details()) == (code, str(exc))
    assert from_store(err.trailing_metadata()) and commit.calls == 1


def test_over_the_wire_a_registry_refusal_has_its_status_and_no_trailer() -> None:
    err = asyncio.run(
        refused(servicer(Refusing(PairNotFound("no pair 'd'")), Commits()), "UnbindPair")
    )
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "no pair 'd'")
    assert not from_store(err.trailing_metadata())


def test_over_the_wire_an_unmapped_exception_is_unknown() -> None:
    err = asyncio.run(refused(servicer(Refusing(KeyError("x")), Commits()), "UnbindPair"))
    assert err.code() is grpc.StatusCode.UNKNOWN
