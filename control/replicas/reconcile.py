"""Bring a replica's registry to the configuration in the store: what a follower does with
each change it watches, what a replica does at start, and how a leader undoes a change etcd
refused. The same overlay rule as control/fleet/db.py: the config file is the base, the
store holds what operators changed at run time."""

# baton: pure

from __future__ import annotations

from collections.abc import Iterable

from baton.model import Backend, BackendId
from baton.pricing import PriceTable
from baton.tenancy import Tenant
from control.fleet.db import Configured, fleet, prices, tenants
from control.fleet.registry import Registry
from control.fleet.sources import CLI, CONFIG
from control.pairs.flow import PairFlow
from control.settings import PairSpec


def reconcile(
    registry: Registry,
    pairs: PairFlow,
    saved: Configured,
    *,
    config_backends: Iterable[Backend] = (),
    config_tenants: Iterable[Tenant] = (),
    config_pairs: Iterable[PairSpec] = (),
    config_prices: PriceTable | None = None,
) -> list[PairSpec]:
    """Changes the registry to `saved` laid over the config file; returns the pairs to bind
    once both sides' facts are read (a bound pair the store no longer holds is unbound)."""
    config_backends = tuple(config_backends)
    want = {b.id: b for b in fleet(config_backends, saved)}
    # A discovered backend is its source's (control/discovery/), not the store's: left alone,
    # unless an operator's takes its id.
    have = {b.id: b for b in registry.backends if not registry.discovered(b.id) or b.id in want}
    for bid, b in have.items():
        if want.get(bid) != b or registry.discovered(bid):
            registry.remove(bid)
    for bid, b in want.items():
        if registry.find(bid) is None:
            registry.add(b, CONFIG if b in config_backends else CLI)
    drained = registry.drained()
    for name, migrate in saved.drained.items():
        backend = want.get(BackendId(name))
        if backend is not None and drained.get(backend.id) != migrate:
            registry.drain(name, migrate=migrate)
    for drained_id in drained:
        if drained_id not in saved.drained and drained_id in want:
            registry.undrain(drained_id)
    registry.tenants.replace(tenants(config_tenants, saved))
    registry.tenants.set_prices(prices(config_prices or PriceTable(), saved))
    # As at a restart: the config file's pairs, and those bound at run time over them.
    wanted = {p.draft: p for p in (*config_pairs, *saved.pairs)}
    for p in list(pairs):
        spec = wanted.get(p.draft_id)
        if spec is None or (spec.target, spec.num_draft_tokens) != (
            p.bound_target_id,
            p.num_draft_tokens,
        ):
            pairs.unbind_pair(p.id)
    bound = {(p.draft_id, p.bound_target_id, p.num_draft_tokens) for p in pairs}
    return [s for s in wanted.values() if (s.draft, s.target, s.num_draft_tokens) not in bound]
