"""A replica's registry brought to the configuration in etcd (control/replicas/reconcile.py):
the config file's backends are the base, the store's overlay wins, drains and tenants follow,
and a change etcd refused is undone by reconciling back."""

from __future__ import annotations

from baton.model import HealthState
from baton.tenancy import Limits, Priority, Tenant
from control.fleet.db import Configured
from control.pairs.flow import PairFlow
from control.replicas.reconcile import reconcile
from control.settings import PairSpec
from tests.factories import backend, registry


def test_the_registry_becomes_the_file_with_the_stores_overlay() -> None:
    reg = registry(["a", "b"])
    config = list(reg.backends)
    saved = Configured(
        added=(backend("c"),),
        removed=frozenset({"a"}),
        drained={"b": True},
        tenants=(Tenant("acme", Priority.BATCH, 2, Limits(concurrent=4)),),
    )
    pairs = reconcile(reg, PairFlow(reg), saved, config_backends=config)
    assert [b.id for b in reg.backends] == ["b", "c"]
    assert reg.drained() == {"b": True}
    assert reg.snapshot.get("b").health.state is HealthState.DRAINING  # type: ignore[union-attr]
    assert [t.id for t in reg.tenants.all()] == ["acme"]
    assert pairs == []
    # Back to the file alone (a write etcd refused is undone this way).
    reconcile(reg, PairFlow(reg), Configured(), config_backends=config)
    assert [b.id for b in reg.backends] == ["a", "b"]
    assert reg.drained() == {}
    assert reg.tenants.all() == ()


def test_a_backend_changed_in_the_store_replaces_the_files_and_pairs_wait_for_facts() -> None:
    reg = registry(["a", "d"])
    config = list(reg.backends)
    moved = backend("a")  # another url than the file's
    saved = Configured(added=(moved,), pairs=(PairSpec("d", "a", 4),))
    pending = reconcile(reg, PairFlow(reg), saved, config_backends=config)
    assert reg.backend("a").url == moved.url
    assert pending == [PairSpec("d", "a", 4)]  # bound once both sides' facts are read
