"""The few etcd v3 calls control's replicas make, over grpc.aio with the stubs the `aetcd`
package generated from etcd's own protos (its generated code agrees with the grpcio and
protobuf Baton pins; its Client serves one endpoint only, so the channel is ours).

Every call has a deadline: a replica never waits on etcd longer than its lease, and an
unreachable etcd is an `EtcdUnavailable` naming the endpoints, never a hang."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd import rpc  # type: ignore[import-untyped]

from control.exceptions import ConfigError

SCHEME = "etcd://"
CALL_TIMEOUT_S = 2.0  # one etcd call; a healthy local etcd answers in a millisecond or two


class EtcdUnavailable(Exception):
    """etcd did not answer (down, unreachable or too slow): nothing was written."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def parse_endpoints(url: str) -> tuple[str, ...]:
    """`etcd://HOST:PORT[,HOST:PORT...]` -> ("HOST:PORT", ...)."""
    if not url.startswith(SCHEME):
        raise ConfigError(f"--store {url!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
    endpoints = tuple(e.strip() for e in url[len(SCHEME) :].split(",") if e.strip())
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--store {url!r}: {e!r} is not HOST:PORT")
    if not endpoints:
        raise ConfigError(f"--store {url!r}: no endpoint")
    return endpoints


def _target(endpoints: Sequence[str]) -> str:
    """One gRPC target over all endpoints: gRPC's `ipv4:`/`ipv6:` lists fail over between
    addresses; names go through DNS, one at a time (the first)."""
    if len(endpoints) == 1:
        return endpoints[0]
    hosts = [e.rpartition(":")[0].strip("[]") for e in endpoints]
    try:
        versions = {ipaddress.ip_address(h).version for h in hosts}
    except ValueError:
        return endpoints[0]
    if versions == {4}:
        return "ipv4:" + ",".join(endpoints)
    if versions == {6}:
        return "ipv6:" + ",".join(endpoints)
    return endpoints[0]


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix` (etcd's convention)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _kv(kv: Any) -> KeyValue:
    return KeyValue(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)


class Etcd:
    def __init__(self, endpoints: Sequence[str], timeout: float = CALL_TIMEOUT_S) -> None:
        self.endpoints = tuple(endpoints)
        self._timeout = timeout
        self._channel = grpc.aio.insecure_channel(
            _target(endpoints),
            options=(
                # A restarted etcd is found again within about a second.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ),
        )
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)

    @property
    def url(self) -> str:
        return SCHEME + ",".join(self.endpoints)

    async def close(self) -> None:
        await self._channel.close()

    def _unavailable(self, exc: grpc.aio.AioRpcError) -> EtcdUnavailable:
        return EtcdUnavailable(f"etcd at {self.url} did not answer ({exc.code().name})")

    async def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return await method(request, timeout=timeout or self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._unavailable(exc) from None

    # -- keys ------------------------------------------------------------------------------

    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key (None: absent) and the store's revision when it was read."""
        resp = await self._call(self._kv.Range, rpc.RangeRequest(key=key))
        return (_kv(resp.kvs[0]) if resp.kvs else None), resp.header.revision

    async def get_prefix(self, prefix: bytes, limit: int = 0) -> tuple[list[KeyValue], int]:
        """Keys under `prefix` in key order (the newest `limit` of them, when set)."""
        request = rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), limit=limit)
        if limit:
            request.sort_order = rpc.RangeRequest.SortOrder.DESCEND
            request.sort_target = rpc.RangeRequest.SortTarget.KEY
        resp = await self._call(self._kv.Range, request)
        kvs = [_kv(kv) for kv in resp.kvs]
        return (kvs[::-1] if limit else kvs), resp.header.revision

    async def get_range(self, key: bytes, range_end: bytes, limit: int = 0) -> list[KeyValue]:
        """Keys from `key` up to (not including) `range_end`, in key order (the first `limit`
        of them, when set)."""
        request = rpc.RangeRequest(key=key, range_end=range_end, limit=max(limit, 0))
        resp = await self._call(self._kv.Range, request)
        return [_kv(kv) for kv in resp.kvs]

    async def count_prefix(self, prefix: bytes) -> int:
        request = rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), count_only=True)
        return int((await self._call(self._kv.Range, request)).count)

    async def keys_prefix(self, prefix: bytes, limit: int) -> list[bytes]:
        """The first `limit` keys under `prefix`, in key order (no values)."""
        request = rpc.RangeRequest(
            key=prefix, range_end=prefix_end(prefix), limit=limit, keys_only=True
        )
        return [kv.key for kv in (await self._call(self._kv.Range, request)).kvs]

    async def txn(
        self, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()
    ) -> tuple[bool, Any]:
        """(succeeded, the TxnResponse)."""
        request = rpc.TxnRequest(
            compare=list(compare), success=list(success), failure=list(failure)
        )
        resp = await self._call(self._kv.Txn, request)
        return bool(resp.succeeded), resp

    async def delete_range(self, key: bytes, range_end: bytes) -> None:
        await self._call(self._kv.DeleteRange, rpc.DeleteRangeRequest(key=key, range_end=range_end))

    # -- leases ----------------------------------------------------------------------------

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be more than asked)."""
        resp = await self._call(self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
        return resp.ID, resp.TTL

    async def keep_alive(self, lease: int, timeout: float) -> int:
        """One keep-alive: the lease's TTL from now, in seconds (<= 0: it has expired)."""
        try:
            async with asyncio.timeout(timeout):
                call = self._lease.LeaseKeepAlive(
                    iter([rpc.LeaseKeepAliveRequest(ID=lease)]), timeout=timeout
                )
                async for reply in call:
                    return int(reply.TTL)
        except grpc.aio.AioRpcError as exc:
            raise self._unavailable(exc) from None
        except TimeoutError:
            raise EtcdUnavailable(
                f"etcd at {self.url} did not answer within {timeout:g}s"
            ) from None
        return 0

    async def revoke(self, lease: int) -> None:
        await self._call(self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease), 1.0)

    # -- watches ---------------------------------------------------------------------------

    async def watch(
        self, key: bytes, start_revision: int, *, prefix: bool = False
    ) -> AsyncIterator[list[tuple[str, KeyValue]]]:
        """Batches of ("put" | "delete", key value) from `start_revision` on, until etcd
        goes away (EtcdUnavailable) or the caller stops iterating."""
        create = rpc.WatchCreateRequest(key=key, start_revision=start_revision)
        if prefix:
            create.range_end = prefix_end(key)
        call = self._watch.Watch(iter([rpc.WatchRequest(create_request=create)]))
        try:
            async for resp in call:
                if resp.compact_revision:
                    raise EtcdUnavailable(
                        f"etcd compacted past revision {start_revision}: read it anew"
                    )
                if resp.events:
                    yield [
                        ("delete" if ev.type == rpc.Event.EventType.DELETE else "put", _kv(ev.kv))
                        for ev in resp.events
                    ]
        except grpc.aio.AioRpcError as exc:
            raise self._unavailable(exc) from None
        finally:
            call.cancel()
        raise EtcdUnavailable(f"etcd at {self.url} ended the watch")


# Transaction pieces, in etcd's own messages.


def compare_create(key: bytes, revision: int) -> Any:
    """The key was created at `revision` (0: the key does not exist)."""
    return rpc.Compare(
        key=key,
        result=rpc.Compare.CompareResult.EQUAL,
        target=rpc.Compare.CompareTarget.CREATE,
        create_revision=revision,
    )


def compare_mod(key: bytes, revision: int) -> Any:
    """The key was last written at `revision` (0: the key does not exist)."""
    return rpc.Compare(
        key=key,
        result=rpc.Compare.CompareResult.EQUAL,
        target=rpc.Compare.CompareTarget.MOD,
        mod_revision=revision,
    )


def put(key: bytes, value: bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def delete(key: bytes) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def get(key: bytes) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))
