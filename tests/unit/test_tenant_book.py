"""control/fleet/tenants.py: a tenant's limits as control's admission counts them."""

from __future__ import annotations

import pytest

from baton.model import Reason
from baton.tenancy import FILE_TENANT, Limited, Limits, Priority, Tenant, digest
from control.exceptions import ConfigError, TenantExists, TenantNotFound
from control.fleet.tenants import TenantBook


def book(**limits: object) -> TenantBook:
    b = TenantBook()
    b.add(Tenant("acme", Priority.STANDARD, 1, Limits(**limits)), digest("k"), now=0.0)  # type: ignore[arg-type]
    return b


def test_concurrency_is_held_until_the_request_ends() -> None:
    b = book(concurrent=2)
    assert b.admit("r1", "acme", "m", 10, 0.0).refused is None
    assert b.admit("r2", "acme", "m", 10, 0.0).refused is None
    third = b.admit("r3", "acme", "m", 10, 0.0)
    assert third.refused is Reason.TENANT_LIMITED
    assert third.quota is not None and third.quota.limited_by is Limited.CONCURRENT
    b.finished("r1", 5, 5, 1.0)
    assert b.admit("r3", "acme", "m", 10, 1.0).refused is None
    b.finished("r1", 5, 5, 1.0)  # reported twice: released once
    assert b.admit("r4", "acme", "m", 10, 1.0).refused is Reason.TENANT_LIMITED


def test_requests_per_minute_slide_and_say_when_a_retry_is_admitted() -> None:
    b = book(requests_per_minute=3)
    for i, t in enumerate((0.0, 10.0, 20.0)):
        admitted = b.admit(f"r{i}", "acme", "m", 0, t)
        assert admitted.refused is None
        b.finished(f"r{i}", 0, 0, t)
    assert admitted.quota is not None and admitted.quota.remaining_requests == 0
    refused = b.admit("r3", "acme", "m", 0, 30.0)
    assert refused.refused is Reason.TENANT_LIMITED and refused.quota is not None
    assert refused.quota.limited_by is Limited.REQUESTS
    assert refused.quota.retry_after_s == pytest.approx(30.0)  # the first ages out at 60 s
    assert b.admit("r3", "acme", "m", 0, 60.0).refused is None


def test_tokens_are_estimated_at_admission_and_corrected_at_the_end() -> None:
    b = book(tokens_per_minute=100)
    assert b.admit("r1", "acme", "m", 90, 0.0).refused is None  # prompt + max_tokens
    assert b.admit("r2", "acme", "m", 90, 0.0).refused is None  # 90 < 100: one more
    assert b.admit("r3", "acme", "m", 10, 0.0).refused is Reason.TENANT_LIMITED
    b.finished("r1", 10, 5, 1.0)  # it used 15, not 90
    b.finished("r2", 10, 5, 1.0)
    later = b.admit("r3", "acme", "m", 10, 2.0)
    assert later.refused is None and later.quota is not None
    assert later.quota.remaining_tokens == 100 - 15 - 15 - 10


def test_an_end_without_usage_keeps_the_estimate() -> None:
    b = book(tokens_per_minute=100)
    b.admit("r1", "acme", "m", 100, 0.0)
    b.finished("r1", 0, 0, 1.0)  # a client gone: the engine's usage is unknown
    assert b.admit("r2", "acme", "m", 1, 2.0).refused is Reason.TENANT_LIMITED


def test_a_request_no_backend_took_costs_nothing() -> None:
    b = book(concurrent=1, tokens_per_minute=10)
    b.admit("r1", "acme", "m", 50, 0.0)
    b.cancel("r1")
    assert b.admit("r2", "acme", "m", 5, 0.0).refused is None


def test_models_unknown_tenants_and_the_key_file_tenant() -> None:
    b = book(models=frozenset({"a"}))
    assert b.admit("r1", "acme", "b", 0, 0.0).refused is Reason.TENANT_MODEL
    assert b.admit("r2", "gone", "a", 0, 0.0).refused is Reason.TENANT_UNKNOWN
    assert b.admit("r3", FILE_TENANT, "a", 0, 0.0).refused is None  # unlimited unless defined
    assert b.admit("r4", "", "a", 0, 0.0).refused is None  # an open shim
    usage = {u.tenant_id: u for u in b.usage()}
    assert usage["acme"].refused == {"model": 1}


def test_keys_rotation_and_revocation() -> None:
    b = TenantBook()
    t = b.add(Tenant("acme"), digest("first"), now=0.0)
    t = b.add_key("acme", digest("second"), now=1.0)
    assert [k.digest for k in t.keys] == [digest("first"), digest("second")]
    t = b.revoke_key("acme", t.keys[0].key_id)
    assert [k.digest for k in t.keys] == [digest("second")]
    with pytest.raises(TenantNotFound):
        b.revoke_key("acme", "nope")
    with pytest.raises(TenantExists):
        b.add(Tenant("acme"), digest("third"), now=2.0)


@pytest.mark.parametrize(
    "tenant",
    [Tenant(""), Tenant("a b"), Tenant("x", weight=0), Tenant("x", limits=Limits(concurrent=0))],
)
def test_bad_tenants_are_refused(tenant: Tenant) -> None:
    with pytest.raises(ConfigError):
        TenantBook().add(tenant, digest("k"), now=0.0)


def test_a_request_whose_end_is_never_reported_is_released_after_a_while() -> None:
    b = book(concurrent=1)
    b.admit("r1", "acme", "m", 0, 0.0)
    assert b.admit("r2", "acme", "m", 0, 10.0).refused is Reason.TENANT_LIMITED
    assert b.expire(10_000.0) == 1
    assert b.admit("r2", "acme", "m", 0, 10_000.0).refused is None


def test_a_request_the_engine_refused_costs_no_tokens() -> None:
    """A 4xx from the engine (say max_tokens past its context): nothing was generated, so its
    estimate (huge, from that max_tokens) does not hold the tenant's window."""
    b = book(tokens_per_minute=100)
    b.admit("r1", "acme", "m", 10**9, 0.0)
    b.finished("r1", 0, 0, 1.0, refused=True)
    assert b.admit("r2", "acme", "m", 5, 2.0).refused is None
