"""`baton tenants ...` against a real control plane: tenants added, listed, updated, removed
and their keys rotated from the CLI; a key shown once and kept only as its digest (in
fleet.db, the audit log and control's output alike); tenants and their keys kept across a
control restart; [[tenants]] from the config file; refusals that say why and change nothing;
the admin token on every tenant RPC."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from baton.v1 import admin_pb2, admin_pb2_grpc, fleet_pb2
from clients.procs import Part
from tests.integration.harness import start_control, write_config

pytestmark = pytest.mark.timeout(240)

# A key the operator made and gave control by digest only (docs: printf %s "$KEY" | sha256sum).
CONFIG_KEY = "sk-from-the-operators-vault"
CONFIG_SHA = hashlib.sha256(CONFIG_KEY.encode()).hexdigest()
CONFIG_TENANTS = f"""
[[tenants]]
id = "ops"
priority = "batch"
weight = 2
requests_per_minute = 30
models = ["toy"]
key_sha256 = ["{CONFIG_SHA}"]
"""


def baton(
    control: Part, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args, "--control", control.ready],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})},
    )  # fmt: skip


def ok(control: Part, *args: str) -> str:
    out = baton(control, *args)
    assert out.returncode == 0, (args, out.stderr)
    assert "Traceback" not in out.stderr
    return out.stdout


def ok_json(control: Part, *args: str) -> Any:
    return json.loads(ok(control, *args, "--json"))


def listed(control: Part) -> dict[str, dict[str, Any]]:
    return {t["id"]: t for t in ok_json(control, "tenants", "list")}


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def refused(control: Part, *args: str) -> subprocess.CompletedProcess[str]:
    out = baton(control, *args)
    assert out.returncode != 0 and "Traceback" not in out.stderr, (args, out.stderr)
    return out


@contextmanager
def control_plane(tmp_path: Path, *extra: str, env: dict[str, str] | None = None,
                  log: Path | None = None) -> Iterator[Part]:  # fmt: skip
    config = write_config(tmp_path / "control.toml", [], extra=CONFIG_TENANTS)
    control = start_control(config, *extra, env=env, log=log)
    try:
        yield control
    finally:
        control.stop(grace=5)


def stop_reading_stdout(control: Part) -> str:
    """Stop control and return what it printed after its READY line."""
    control.proc.send_signal(signal.SIGTERM)
    control.proc.wait(15)
    assert control.proc.stdout is not None
    printed = control.proc.stdout.read()
    control.stop()  # closes the pipe
    return printed


def test_tenants_from_the_cli_keys_shown_once_stored_hashed_and_kept_across_restarts(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    log = tmp_path / "control.log"
    flags = ("--data-dir", str(data), "--log-level", "DEBUG")
    keys: list[str] = []
    config = write_config(tmp_path / "control.toml", [], extra=CONFIG_TENANTS)
    control = start_control(config, *flags, log=log)
    try:
        # The config file's tenant, with its key by digest (no creation time: the file's).
        ops = listed(control)["ops"]
        assert (ops["priority"], ops["weight"]) == ("batch", 2)
        assert ops["limits"] == {"concurrent": None, "requests_per_minute": 30,
                                 "tokens_per_minute": None, "models": ["toy"]}  # fmt: skip
        assert ops["keys"] == [{"key_id": CONFIG_SHA[:12], "created": None}]

        added = ok_json(control, "tenants", "add", "acme", "--priority", "interactive",
                        "--weight", "2", "--concurrent", "4", "--rpm", "60",
                        "--models", "toy,other")  # fmt: skip
        first = added["key"]
        keys.append(first)
        assert first.startswith("sk-baton-") and added["key_id"] == key_id(first)
        assert added["tenant"]["keys"][0]["key_id"] == key_id(first)
        assert added["tenant"]["limits"] == {"concurrent": 4, "requests_per_minute": 60,
                                             "tokens_per_minute": None,
                                             "models": ["other", "toy"]}  # fmt: skip

        # Without --json: the tenant, the key on a line of its own, and the one-time notice.
        text = ok(control, "tenants", "add", "beta")
        match = re.search(r"^key ([0-9a-f]{12}): (\S+)$", text, re.MULTILINE)
        assert match is not None and "will not be shown again" in text, text
        assert match.group(1) == key_id(match.group(2))
        keys.append(match.group(2))

        rotated = ok_json(control, "tenants", "keys", "add", "acme")
        second = rotated["key"]
        keys.append(second)
        assert second != first
        assert [k["key_id"] for k in rotated["tenant"]["keys"]] == [key_id(first), key_id(second)]
        keys.append(ok_json(control, "tenants", "keys", "add", "ops")["key"])

        updated = ok_json(control, "tenants", "update", "acme", "--no-rpm", "--tpm", "5000",
                          "--all-models", "--weight", "3")  # fmt: skip
        assert (updated["priority"], updated["weight"]) == ("interactive", 3)  # kept, changed
        assert updated["limits"] == {"concurrent": 4, "requests_per_minute": None,
                                     "tokens_per_minute": 5000, "models": []}  # fmt: skip
        assert len(updated["keys"]) == 2  # an update leaves the keys alone

        revoked = ok_json(control, "tenants", "keys", "revoke", "acme", key_id(first))
        assert [k["key_id"] for k in revoked["keys"]] == [key_id(second)]
        ok(control, "tenants", "remove", "beta")

        before = listed(control)
        assert sorted(before) == ["acme", "ops"]
        assert [k["key_id"] for k in before["ops"]["keys"]] == [CONFIG_SHA[:12], key_id(keys[3])]
        table = ok(control, "tenants", "list")
        assert key_id(second) in table and CONFIG_SHA not in table  # ids, never whole digests
        actions = [e["action"] for e in ok_json(control, "events", "--kind", "admin")]
        assert actions == ["add-tenant", "add-tenant", "add-tenant-key", "add-tenant-key",
                           "update-tenant", "revoke-tenant-key", "remove-tenant"]  # fmt: skip
        events_text = ok(control, "events", "--kind", "admin", "--json")
        assert key_id(second) in events_text
        printed = stop_reading_stdout(control)

        # Keys are nowhere at rest or in control's output; their digests are in fleet.db.
        at_rest = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}
        assert any(p.name.startswith("events") for p in at_rest)
        for key in keys:
            for path, content in at_rest.items():
                assert key.encode() not in content, f"a key in {path}"
            assert key not in printed and key.encode() not in log.read_bytes()
            assert key not in events_text and key not in table
        with sqlite3.connect(data / "fleet.db") as db:
            saved = dict(db.execute("SELECT id, keys FROM tenants").fetchall())
        assert hashlib.sha256(second.encode()).hexdigest() in saved["acme"]
        assert "beta" not in saved

        # A restart with the same --data-dir: the same tenants, keys (by digest) and times.
        control = start_control(config, *flags, log=log)
        assert listed(control) == before
        with grpc.insecure_channel(control.ready) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            got = stub.ListTenants(admin_pb2.ListTenantsRequest(), timeout=10).tenants
        digests = {t.id: [k.digest for k in t.keys] for t in got}
        # The key made before the restart still maps to its tenant.
        assert digests["acme"] == [hashlib.sha256(second.encode()).digest()]
        assert digests["ops"][0] == bytes.fromhex(CONFIG_SHA)
        # "ops" changed at run time (a key added): the file's entry no longer applies, and
        # control says so, with the way back.
        said = log.read_text()
        assert "tenant 'ops'" in said and "replaces the config file's" in said
        assert "DELETE FROM tenants WHERE id = 'ops'" in said
        # The removed tenant stays removed; the operator's latest word wins over the file.
        ok(control, "tenants", "remove", "ops")
        control.stop(grace=5)
        control = start_control(config, *flags, log=log)
        assert sorted(listed(control)) == ["acme"]
    finally:
        control.stop(grace=5)


def test_bad_input_is_refused_by_name_and_changes_nothing(tmp_path: Path) -> None:
    with control_plane(tmp_path) as control:
        ok_json(control, "tenants", "add", "acme")
        before = listed(control)
        cases = [
            (("tenants", "add", "bad id"), "INVALID_ARGUMENT", "a tenant id is"),
            (("tenants", "add", "x", "--rpm", "0"), "INVALID_ARGUMENT",
             "requests_per_minute must be at least 1"),
            (("tenants", "add", "x", "--weight", "0"), "--weight", "not in 1.."),
            (("tenants", "add", "acme"), "ALREADY_EXISTS", "acme"),
            (("tenants", "update", "acme", "--concurrent", "0"), "INVALID_ARGUMENT",
             "concurrent must be at least 1"),
            (("tenants", "update", "nope", "--weight", "2"), "NOT_FOUND", "nope"),
            (("tenants", "remove", "nope"), "NOT_FOUND", "no tenant 'nope'"),
            (("tenants", "keys", "add", "nope"), "NOT_FOUND", "nope"),
            (("tenants", "keys", "revoke", "acme", "000000000000"), "NOT_FOUND", "no key"),
            (("tenants", "usage", "--since", "yesterday-ish"), "--since", "5m"),
        ]  # fmt: skip
        for args, code, said in cases:
            out = refused(control, *args)
            assert code in out.stderr and said in out.stderr, (args, out.stderr)
        assert listed(control) == before
        assert [e["action"] for e in ok_json(control, "events", "--kind", "admin")] == [
            "add-tenant"
        ]
        usage = ok_json(control, "tenants", "usage", "--since", "10m")
        assert {u["tenant"]: u["requests"] for u in usage} == {"acme": 0, "ops": 0}


TOKENS = {"BATON_ADMIN_TOKEN": "tenant-admin-token", "BATON_SHIM_TOKEN": "tenant-shim-token"}


def test_every_tenant_rpc_needs_the_admin_token(tmp_path: Path) -> None:
    tenant = fleet_pb2.Tenant(id="intruder", priority=fleet_pb2.PRIORITY_CLASS_INTERACTIVE,
                              weight=1)  # fmt: skip
    calls = {
        "AddTenant": admin_pb2.AddTenantRequest(tenant=tenant),
        "UpdateTenant": admin_pb2.UpdateTenantRequest(
            tenant=fleet_pb2.Tenant(id="ops", priority=fleet_pb2.PRIORITY_CLASS_INTERACTIVE,
                                    weight=9)),
        "RemoveTenant": admin_pb2.RemoveTenantRequest(id="ops"),
        "ListTenants": admin_pb2.ListTenantsRequest(),
        "AddTenantKey": admin_pb2.AddTenantKeyRequest(tenant_id="ops"),
        "RevokeTenantKey": admin_pb2.RevokeTenantKeyRequest(tenant_id="ops",
                                                            key_id=CONFIG_SHA[:12]),
        "TenantUsage": admin_pb2.TenantUsageRequest(),
    }  # fmt: skip
    tenant_rpcs = {n for n in admin_pb2.DESCRIPTOR.services_by_name["AdminService"].methods_by_name
                   if "Tenant" in n}  # fmt: skip
    assert set(calls) == tenant_rpcs
    with control_plane(tmp_path, env=TOKENS) as control:
        env = {"BATON_ADMIN_TOKEN": TOKENS["BATON_ADMIN_TOKEN"]}
        before = baton(control, "tenants", "list", "--json", env=env)
        assert before.returncode == 0, before.stderr
        denied = baton(control, "tenants", "add", "intruder", env={"BATON_ADMIN_TOKEN": ""})
        assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
        with grpc.insecure_channel(control.ready) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            for name, request in calls.items():
                for md in ((), (("authorization", "Bearer guess"),)):
                    with pytest.raises(grpc.RpcError) as err:
                        getattr(stub, name)(request, metadata=md, timeout=10)
                    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, name
        after = baton(control, "tenants", "list", "--json", env=env)
        assert json.loads(after.stdout) == json.loads(before.stdout)
        assert [t["id"] for t in json.loads(after.stdout)] == ["ops"]
