"""Tenants as operators manage them: the admin RPCs over an in-process registry, the audit
events they leave (key ids, never keys), fleet.db's tenant overlay, the config file's
[[tenants]], and the CLI's rendering and flags."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from baton import wire
from baton.model import Backend
from baton.tenancy import Limits, Priority, Tenant, TenantKey, digest, key_id
from baton.v1 import admin_pb2, fleet_pb2
from clients import cli, render, tenant_commands
from clients.client import AdminError, TenantSpec
from control.api import convert
from control.api.admin import AdminServicer
from control.audit.durable import EventFile
from control.audit.log import EventLog
from control.config import parse
from control.exceptions import ConfigError
from control.fleet.db import (
    Configured,
    FleetDB,
    configured,
    shadowed_tenants,
    tenant_overlay,
    tenants,
)
from control.fleet.registry import Registry
from control.routing.policy import make_policy
from control.routing.router import Router
from control.signals.facts import Facts
from tests.unit.test_audit_schema import schema_errors

NOW = 1_800_000_000.0


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class FakeContext:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None


async def no_facts(backend: Backend, within: float) -> Facts:
    raise AssertionError("no facts are read for tenants")


class Admin:
    """An AdminServicer over a fresh registry, its audit log written to a file."""

    def __init__(self, tmp_path: Path, config: tuple[Tenant, ...] = ()) -> None:
        self.file = EventFile(tmp_path / "events.jsonl")
        events = EventLog(lambda: NOW, sink=self.file.append, durable=self.file.flush)
        self.registry = Registry([], clock=lambda: NOW, events=events, tenants=config)
        router = Router(self.registry, make_policy("adaptive"),
                        clock=lambda: NOW, route_events=False)  # fmt: skip
        self.saves = 0
        self.servicer = AdminServicer(router, no_facts, on_changed=self._saved)

    async def _saved(self) -> None:
        self.saves += 1

    def call(self, method: str, request: object) -> Any:
        rpc: Callable[[object, FakeContext], Coroutine[Any, Any, Any]]
        rpc = getattr(self.servicer, method)
        return asyncio.run(rpc(request, FakeContext()))

    def refused(self, method: str, request: object) -> Aborted:
        with pytest.raises(Aborted) as err:
            self.call(method, request)
        return err.value

    def rows(self) -> list[dict[str, Any]]:
        self.file.flush()
        return [orjson.loads(line) for line in self.file.path.read_bytes().splitlines()]


def pb_tenant(tid: str = "acme", **kw: Any) -> fleet_pb2.Tenant:
    return fleet_pb2.Tenant(id=tid, **kw)


def test_add_returns_the_key_once_and_keeps_only_its_digest(tmp_path: Path) -> None:
    a = Admin(tmp_path)
    limits = fleet_pb2.TenantLimits(requests_per_minute=60, models=["m"])
    resp = a.call("AddTenant", admin_pb2.AddTenantRequest(tenant=pb_tenant(
        priority=fleet_pb2.PRIORITY_CLASS_INTERACTIVE, weight=3, limits=limits)))  # fmt: skip
    key = resp.key
    assert key.startswith("sk-baton-") and a.saves == 1
    (held,) = a.registry.tenants.all()
    assert held.keys == (TenantKey(digest(key), NOW),)
    assert (held.priority, held.weight) == (Priority.INTERACTIVE, 3)
    assert held.limits == Limits(requests_per_minute=60, models=frozenset({"m"}))
    assert wire.tenant_from_pb(resp.tenant) == held
    # Shims learn the tenant from the snapshot: by digest.
    assert a.registry.snapshot.tenants == (held,)
    (event,) = a.rows()
    assert event["action"] == "add-tenant" and event["tenant"] == "acme"
    assert event["key_id"] == key_id(digest(key)) and key not in orjson.dumps(event).decode()
    assert event["limits"] == "requests_per_minute=60 models=m"
    assert schema_errors(event) == []
    # Listing shows the key's id and digest, never the key.
    listed = a.call("ListTenants", admin_pb2.ListTenantsRequest())
    assert key.encode() not in listed.SerializeToString()


def test_an_unset_class_and_weight_on_add_are_standard_and_1(tmp_path: Path) -> None:
    a = Admin(tmp_path)
    a.call("AddTenant", admin_pb2.AddTenantRequest(tenant=pb_tenant()))
    (t,) = a.registry.tenants.all()
    assert (t.priority, t.weight, t.limits) == (Priority.STANDARD, 1, Limits())


@pytest.mark.parametrize(
    ("tenant", "code", "said"),
    [
        (pb_tenant("bad id"), grpc.StatusCode.INVALID_ARGUMENT, "letters, digits"),
        (pb_tenant("x", limits=fleet_pb2.TenantLimits(requests_per_minute=0)),
         grpc.StatusCode.INVALID_ARGUMENT, "requests_per_minute must be at least 1"),
        (pb_tenant("x", limits=fleet_pb2.TenantLimits(concurrent=0)),
         grpc.StatusCode.INVALID_ARGUMENT, "concurrent must be at least 1"),
        (pb_tenant("x", priority=9), grpc.StatusCode.INVALID_ARGUMENT, "unknown priority"),
        (pb_tenant("x", limits=fleet_pb2.TenantLimits(models=[" "])),
         grpc.StatusCode.INVALID_ARGUMENT, "model name is empty"),
        (pb_tenant("acme"), grpc.StatusCode.ALREADY_EXISTS, "'acme' exists"),
    ],
    ids=["id", "rpm-0", "concurrent-0", "priority", "empty-model", "exists"],
)  # fmt: skip
def test_a_refused_add_says_why_and_changes_nothing(
    tmp_path: Path, tenant: fleet_pb2.Tenant, code: grpc.StatusCode, said: str
) -> None:
    a = Admin(tmp_path, (Tenant("acme"),))
    before = (a.registry.tenants.all(), a.registry.snapshot.version)
    err = a.refused("AddTenant", admin_pb2.AddTenantRequest(tenant=tenant))
    assert err.code == code and said in err.details
    assert (a.registry.tenants.all(), a.registry.snapshot.version) == before
    assert a.saves == 0 and a.rows() == []


def test_update_replaces_the_configuration_and_keeps_the_keys(tmp_path: Path) -> None:
    a = Admin(tmp_path)
    key = a.call("AddTenant", admin_pb2.AddTenantRequest(tenant=pb_tenant())).key
    new = pb_tenant(priority=fleet_pb2.PRIORITY_CLASS_BATCH, weight=5,
                    limits=fleet_pb2.TenantLimits(concurrent=2))  # fmt: skip
    resp = a.call("UpdateTenant", admin_pb2.UpdateTenantRequest(tenant=new))
    (t,) = a.registry.tenants.all()
    assert (t.priority, t.weight, t.limits) == (Priority.BATCH, 5, Limits(concurrent=2))
    assert [k.digest for k in t.keys] == [digest(key)] and wire.tenant_from_pb(resp.tenant) == t
    event = a.rows()[-1]
    assert (event["action"], event["priority"], event["weight"], event["limits"]) == (
        "update-tenant", "batch", 5, "concurrent=2",
    )  # fmt: skip
    assert "key_id" not in event and schema_errors(event) == []


@pytest.mark.parametrize(
    ("tenant", "code", "said"),
    [
        (pb_tenant(weight=2), grpc.StatusCode.INVALID_ARGUMENT, "says the priority class"),
        (pb_tenant(priority=fleet_pb2.PRIORITY_CLASS_BATCH), grpc.StatusCode.INVALID_ARGUMENT,
         "weight must be at least 1"),
        (pb_tenant("nope", priority=fleet_pb2.PRIORITY_CLASS_BATCH, weight=1),
         grpc.StatusCode.NOT_FOUND, "no tenant 'nope'"),
    ],
    ids=["no-priority", "no-weight", "unknown"],
)  # fmt: skip
def test_an_update_says_the_whole_tenant_or_is_refused(
    tmp_path: Path, tenant: fleet_pb2.Tenant, code: grpc.StatusCode, said: str
) -> None:
    a = Admin(tmp_path, (Tenant("acme", Priority.INTERACTIVE, 4),))
    before = a.registry.tenants.all()
    err = a.refused("UpdateTenant", admin_pb2.UpdateTenantRequest(tenant=tenant))
    assert err.code == code and said in err.details
    assert a.registry.tenants.all() == before and a.saves == 0


def test_rotation_adds_a_key_beside_the_first_and_revokes_the_old_one(tmp_path: Path) -> None:
    a = Admin(tmp_path)
    first = a.call("AddTenant", admin_pb2.AddTenantRequest(tenant=pb_tenant())).key
    second = a.call("AddTenantKey", admin_pb2.AddTenantKeyRequest(tenant_id="acme")).key
    assert first != second
    (t,) = a.registry.tenants.all()
    assert [k.digest for k in t.keys] == [digest(first), digest(second)]
    old = key_id(digest(first))
    resp = a.call("RevokeTenantKey", admin_pb2.RevokeTenantKeyRequest(tenant_id="acme",
                                                                       key_id=old))  # fmt: skip
    assert [k.key_id for k in resp.tenant.keys] == [key_id(digest(second))]
    err = a.refused("RevokeTenantKey", admin_pb2.RevokeTenantKeyRequest(tenant_id="acme",
                                                                         key_id=old))  # fmt: skip
    assert err.code is grpc.StatusCode.NOT_FOUND
    err = a.refused("AddTenantKey", admin_pb2.AddTenantKeyRequest(tenant_id="nope"))
    assert err.code is grpc.StatusCode.NOT_FOUND
    rows = a.rows()
    assert [(r["action"], r.get("key_id")) for r in rows] == [
        ("add-tenant", old), ("add-tenant-key", key_id(digest(second))),
        ("revoke-tenant-key", old),
    ]  # fmt: skip
    text = orjson.dumps(rows).decode()
    assert first not in text and second not in text
    assert [e for r in rows for e in schema_errors(r)] == []
    assert a.saves == 3


def test_remove_forgets_the_tenant_and_an_unknown_one_is_not_found(tmp_path: Path) -> None:
    a = Admin(tmp_path, (Tenant("acme"), Tenant("other")))
    a.call("RemoveTenant", admin_pb2.RemoveTenantRequest(id="acme"))
    assert [t.id for t in a.registry.tenants.all()] == ["other"]
    assert [t.id for t in a.registry.snapshot.tenants] == ["other"]
    err = a.refused("RemoveTenant", admin_pb2.RemoveTenantRequest(id="acme"))
    assert err.code is grpc.StatusCode.NOT_FOUND and "acme" in err.details
    assert [r["action"] for r in a.rows()] == ["remove-tenant"] and a.saves == 1


def test_usage_lists_every_tenant(tmp_path: Path) -> None:
    a = Admin(tmp_path, (Tenant("acme"), Tenant("idle")))
    a.registry.tenants.admit("r1", "acme", "m", 10, NOW)
    resp = a.call("TenantUsage", admin_pb2.TenantUsageRequest())
    rows = {u.tenant_id: u for u in resp.usage}
    assert set(rows) == {"acme", "idle"}
    assert (rows["acme"].requests, rows["acme"].in_flight) == (1, 1)
    assert (rows["idle"].requests, rows["idle"].in_flight) == (0, 0)
    later = admin_pb2.TenantUsageRequest()
    later.since.FromSeconds(int(NOW) + 3600)
    after = a.call("TenantUsage", later)
    assert {u.tenant_id: u.requests for u in after.usage}["acme"] == 0


# -- fleet.db ---------------------------------------------------------------------------------

K1, K2, K3 = (TenantKey(hashlib.sha256(k).digest(), c) for k, c in
              ((b"k1", 0.0), (b"k2", NOW), (b"k3", NOW + 1.5)))  # fmt: skip
CFG = (Tenant("a", keys=(K1,)), Tenant("b", Priority.BATCH))


def test_tenants_round_trip_through_fleet_db_by_digest(tmp_path: Path) -> None:
    full = Tenant("t", Priority.INTERACTIVE, 7,
                  Limits(3, 60, 10**12, frozenset({"m1", "m2"})), (K2, K3))  # fmt: skip
    db = FleetDB(tmp_path / "fleet.db")
    db.save(configured([], [], {}, [], config_tenants=CFG, current_tenants=(full, CFG[0])))
    db.close()
    saved = FleetDB(tmp_path / "fleet.db").load()
    assert saved.tenants == (full,) and saved.tenants_removed == {"b"}
    assert tenants(CFG, saved) == [CFG[0], full]


@pytest.mark.parametrize(
    ("current", "added", "removed"),
    [
        (CFG, (), set()),  # nothing changed at run time: nothing kept
        ((CFG[0], Tenant("b", Priority.BATCH, keys=(K2,))),  # a key added to a config tenant
         (Tenant("b", Priority.BATCH, keys=(K2,)),), set()),
        ((CFG[1],), (), {"a"}),
        ((*CFG, Tenant("c")), (Tenant("c"),), set()),
    ],
)  # fmt: skip
def test_the_tenant_overlay_is_the_difference_and_applies_back(
    current: tuple[Tenant, ...], added: tuple[Tenant, ...], removed: set[str]
) -> None:
    got_added, got_removed = tenant_overlay(CFG, current)
    assert got_added == added and got_removed == removed
    saved = Configured(tenants=got_added, tenants_removed=got_removed)
    assert sorted(tenants(CFG, saved), key=lambda t: t.id) == sorted(current, key=lambda t: t.id)


def test_a_config_tenant_changed_at_run_time_is_shadowed_and_a_new_one_appears() -> None:
    saved = Configured(tenants=(Tenant("a", Priority.BATCH, keys=(K1, K2)),))
    assert shadowed_tenants(CFG, saved) == [CFG[0]]
    later = (*CFG, Tenant("z"))  # the operator added "z" to the file since
    assert {t.id for t in tenants(later, saved)} == {"a", "b", "z"}


@pytest.mark.parametrize(
    ("limits", "keys"),
    [
        ('{"concurrent": "4", "requests_per_minute": null, "tokens_per_minute": null, '
         '"models": []}', "[]"),
        ('{"models": []}', "[]"),
        ('{"concurrent": null, "requests_per_minute": null, "tokens_per_minute": null, '
         '"models": []}', '[{"sha256": "abcd", "created": 0}]'),
    ],
    ids=["string-limit", "missing-limit", "short-digest"],
)  # fmt: skip
def test_a_tenant_row_that_is_not_what_control_writes_is_refused(
    tmp_path: Path, limits: str, keys: str
) -> None:
    db = FleetDB(tmp_path / "fleet.db")
    db._db.execute("INSERT INTO tenants VALUES (?, ?, ?, ?, ?)", ("t", "batch", 1, limits, keys))
    with pytest.raises(ConfigError, match="tenant 't'"):
        db.load()


# -- the config file ------------------------------------------------------------------------

HEX = hashlib.sha256(b"sk-baton-secret").hexdigest()


def test_config_tenants_load_with_their_digests() -> None:
    cfg = parse({"tenants": [
        {"id": "acme", "priority": "interactive", "weight": 2, "concurrent": 4,
         "requests_per_minute": 60, "tokens_per_minute": 100000, "models": ["m"],
         "key_sha256": [HEX.upper()]},
        {"id": "bulk"},
    ]})  # fmt: skip
    acme, bulk = cfg.tenants
    assert acme == Tenant("acme", Priority.INTERACTIVE, 2, Limits(4, 60, 100000, frozenset({"m"})),
                          (TenantKey(bytes.fromhex(HEX), 0.0),))  # fmt: skip
    assert bulk == Tenant("bulk")
    assert digest("sk-baton-secret") == acme.keys[0].digest  # what sha256sum prints


@pytest.mark.parametrize(
    ("tenants_", "message"),
    [
        ([{"id": "a", "colour": "red"}], "unknown keys"),
        ([{"priority": "batch"}], "missing id"),
        ([{"id": "a b"}], "tenant id"),
        ([{"id": "a", "priority": "urgent"}], "priority must be one of"),
        ([{"id": "a", "weight": 0}], "weight must be a whole number of at least 1"),
        ([{"id": "a", "requests_per_minute": 0}], "requests_per_minute must be"),
        ([{"id": "a", "concurrent": True}], "concurrent must be"),
        ([{"id": "a", "models": "m"}], "models must be a list"),
        ([{"id": "a"}, {"id": "a"}], "unique"),
        ([{"id": "a", "key_sha256": [HEX]}, {"id": "b", "key_sha256": [HEX]}], "listed twice"),
        ({"id": "a"}, "array of tables"),
    ],
)  # fmt: skip
def test_bad_config_tenants_are_refused_with_a_reason(tenants_: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse({"tenants": tenants_})


def test_a_key_pasted_where_a_digest_goes_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as err:
        parse({"tenants": [{"id": "a", "key_sha256": ["sk-baton-secret"]}]})
    assert "sk-baton-secret" not in str(err.value) and "sha256sum" in str(err.value)


# -- the CLI --------------------------------------------------------------------------------

ROW = {"id": "acme", "priority": "batch", "weight": 2,
       "limits": {"concurrent": None, "requests_per_minute": 60, "tokens_per_minute": None,
                  "models": ["a", "b"]},
       "keys": [{"key_id": "0123456789ab", "created": "2027-01-15T08:00:00+00:00"},
                {"key_id": "ba9876543210", "created": None}]}  # fmt: skip


def test_a_tenant_shows_its_limits_and_key_ids() -> None:
    header, line = render.tenants([ROW]).splitlines()
    assert header.split() == ["ID", "PRIORITY", "WEIGHT", "CONCURRENT", "RPM", "TPM", "MODELS",
                              "BUDGETS", "KEYS"]  # fmt: skip
    assert line.split()[:8] == ["acme", "batch", "2", "-", "60", "-", "a,b", "-"]
    assert "0123456789ab (2027-01-15T08:00:00+00:00), ba9876543210 (config)" in line
    assert render.tenants([]).startswith("no tenants")


def test_a_new_key_is_printed_with_the_notice_that_it_is_shown_once() -> None:
    text = render.new_key(ROW, "sk-baton-xyz", "ba9876543210", "added tenant acme")
    assert "key ba9876543210: sk-baton-xyz" in text and "will not be shown again" in text


def test_usage_says_what_refused_requests() -> None:
    rows = [{"tenant": "acme", "requests": 3, "prompt_tokens": 10, "completion_tokens": 20,
             "refused": {"concurrent": 2, "model": 1}, "in_flight": 1,
             "queued_seconds": 0.5}]  # fmt: skip
    assert "concurrent=2 model=1" in render.usage(rows)


class FakeClient:
    """Records what the CLI asked control for."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.sent: list[tuple[str, object]] = []

    def tenants(self) -> list[dict[str, Any]]:
        return self.rows

    def update_tenant(self, spec: TenantSpec) -> dict[str, Any]:
        self.sent.append(("update", spec))
        return ROW

    def revoke_tenant_key(self, id: str, key_id: str) -> dict[str, Any]:
        self.sent.append(("revoke", key_id))
        return ROW


def run(argv: list[str], client: FakeClient) -> None:
    args = cli.build_parser().parse_args(argv)
    args.admin(args, client)


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (["--weight", "5"], TenantSpec("acme", "batch", 5, None, 60, None, ("a", "b"))),
        (["--no-rpm", "--tpm", "900", "--all-models"],
         TenantSpec("acme", "batch", 2, None, None, 900, ())),
        (["--priority", "interactive", "--models", "c, a,"],
         TenantSpec("acme", "interactive", 2, None, 60, None, ("a", "c"))),
    ],
)  # fmt: skip
def test_update_changes_what_the_flags_say_over_the_tenant_as_it_is(
    flags: list[str], want: TenantSpec, capsys: pytest.CaptureFixture[str]
) -> None:
    client = FakeClient([ROW])
    run(["tenants", "update", "acme", *flags], client)
    assert client.sent == [("update", want)]
    assert "updated tenant acme" in capsys.readouterr().out


def test_update_with_nothing_to_change_or_two_words_for_one_limit_is_refused() -> None:
    with pytest.raises(AdminError, match="nothing to change"):
        run(["tenants", "update", "acme"], FakeClient([ROW]))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tenants", "update", "acme", "--rpm", "5", "--no-rpm"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tenants", "add", "acme", "--weight", "0"])


def test_a_key_given_to_revoke_is_never_sent() -> None:
    client = FakeClient([ROW])
    with pytest.raises(AdminError, match="not a key id"):
        run(["tenants", "keys", "revoke", "acme", "sk-baton-oops"], client)
    assert client.sent == []
    run(["tenants", "keys", "revoke", "acme", "0123456789AB"], client)
    assert client.sent == [("revoke", "0123456789ab")]


def test_whole_numbers_are_bounded_by_what_the_wire_carries() -> None:
    parse_rpm = tenant_commands._whole(0, tenant_commands.UINT32)
    assert parse_rpm("0") == 0 and parse_rpm("4294967295") == 2**32 - 1
    for bad in ("-1", "4294967296", "ten"):
        with pytest.raises(Exception, match="not"):
            parse_rpm(bad)


def test_convert_says_a_tenants_limits_as_the_audit_log_does() -> None:
    assert convert.limits_text(Limits()) == ""
    assert convert.limits_text(Limits(1, None, 5, frozenset({"b", "a"}))) == (
        "concurrent=1 tokens_per_minute=5 models=a,b"
    )
