"""Pairs configured (in the config file, or bound before a restart, or in a replica's store)
that wait for both backends' facts, which the prober's refresher reads as backends answer;
each is bound once both are known. A refusal is a `pair` audit event, not a crash."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from baton.model import Backend, BackendId, Role
from control.audit.payloads import PairChange
from control.exceptions import RegistryError
from control.fleet.registry import Registry
from control.pairs.flow import PairFlow
from control.settings import PairSpec

log = logging.getLogger("baton.control")


class PendingPairs:
    def __init__(self, registry: Registry, pairs: PairFlow, specs: Iterable[PairSpec]) -> None:
        self._registry = registry
        self._pairs = pairs
        self.specs = list({p.draft: p for p in specs}.values())  # the last word per draft

    def __bool__(self) -> bool:
        return bool(self.specs)

    def add(self, specs: Iterable[PairSpec]) -> None:
        """More pairs to bind; one of a draft already waiting replaces it."""
        pending = {p.draft: p for p in self.specs}
        pending.update((p.draft, p) for p in specs)
        self.specs = list(pending.values())

    def wants_facts(self, backend: Backend) -> bool:
        """Whether a pair may need this backend's facts: a draft, a configured pair's
        target, or a backend of a model some pair serves (the draft may be re-bound to it)."""
        if backend.role is Role.DRAFT or any(s.target == backend.id for s in self.specs):
            return True
        return any(p.model == backend.model for p in self._pairs)

    async def bind(self) -> None:
        """Bind each pending pair once control has read both backends' facts."""
        reg = self._registry
        while self.specs:
            waiting = []
            for spec in self.specs:
                draft, target = (
                    reg.facts.get(BackendId(spec.draft)),
                    reg.facts.get(BackendId(spec.target)),
                )
                if draft is None or target is None:
                    waiting.append(spec)
                    continue
                try:
                    self._pairs.bind_pair(
                        spec.draft, spec.target, spec.num_draft_tokens, draft, target
                    )
                except RegistryError as exc:
                    log.warning("pair %s -> %s not bound: %s", spec.draft, spec.target, exc)
                    refused = PairChange(pair=spec.draft, action="refused", reason=str(exc))
                    reg.events.record(refused, backend_id=spec.target)
            self.specs = waiting
            await asyncio.sleep(0.2)

    def configured(self) -> list[PairSpec]:
        """The configuration's pairs: those bound (to the target the operator bound them
        to), and those still waiting for facts, unless their draft is gone."""
        bound = [PairSpec(p.draft_id, p.bound_target_id, p.num_draft_tokens) for p in self._pairs]
        known = {b.id for b in self._registry.backends}
        waiting = [p for p in self.specs if p.draft in known and p.draft not in
                   {b.draft for b in bound}]  # fmt: skip
        return [*waiting, *bound]
