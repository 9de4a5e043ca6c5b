"""Discovery's applier (control/discovery/runner.py) with control replicas: every replica
keeps its view, only the leader changes the fleet, and a replica that becomes leader acts at
once on what it already sees."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from random import Random

import aiohttp

from control.discovery.endpoints import Endpoint, Phase
from control.discovery.runner import Discovery
from control.discovery.settings import DiscoverySettings, Engine, KubeSource
from control.fleet.registry import Registry

SRC = KubeSource("llm", service="vllm", engine=Engine(model="m"))


async def settle(turns: int = 200) -> None:
    """Lets the loop run the applier's pending steps (no I/O here: a few turns suffice)."""
    for _ in range(turns):
        await asyncio.sleep(0)


def no_http() -> aiohttp.ClientSession:
    raise AssertionError("the model is configured: no engine is asked")


def test_only_the_leader_acts_and_a_new_leader_acts_on_what_it_sees() -> None:
    async def go() -> None:
        reg = Registry([], clock=lambda: 1.0)
        leads = [False]
        d = Discovery(reg, DiscoverySettings((SRC,)), leading=lambda: leads[0], http=no_http,
                      rng=Random(0))  # fmt: skip
        applier = asyncio.create_task(d.apply_forever())
        try:
            d.saw(SRC, {"llm/p": Endpoint("llm/p", "10.0.0.1", 8000, Phase.READY)})
            await settle()
            assert reg.backends == () and set(d.view(SRC.name)) == {"llm/p"}
            leads[0] = True
            d.poke()  # as ControlPlane does when this replica is elected
            await settle()
            assert [(b.id, b.url, b.model) for b in reg.backends] == [
                ("llm/p", "http://10.0.0.1:8000", "m")]  # fmt: skip
            assert reg.snapshot.backends[0].source == SRC.name
        finally:
            applier.cancel()

    asyncio.run(go())


def test_a_new_leader_drains_with_migrate_an_endpoint_that_terminated_while_none_led() -> None:
    """A follower's registry holds no discovered backend: an endpoint it saw ready, then
    terminating before it was elected, is still drained with migrate (not left out as one
    that never joined); one never seen ready does not join."""

    async def go() -> None:
        reg = Registry([], clock=lambda: 1.0)
        leads = [False]
        d = Discovery(reg, DiscoverySettings((SRC,)), leading=lambda: leads[0], http=no_http,
                      rng=Random(0))  # fmt: skip
        applier = asyncio.create_task(d.apply_forever())
        try:
            p = Endpoint("llm/p", "10.0.0.1", 8000, Phase.READY)
            q = Endpoint("llm/q", "10.0.0.2", 8000, Phase.NOT_READY)
            d.saw(SRC, {"llm/p": p, "llm/q": q})
            d.saw(SRC, {"llm/p": replace(p, phase=Phase.TERMINATING), "llm/q": q})
            await settle()
            assert reg.backends == ()
            leads[0] = True
            d.poke()
            await settle()
            (s,) = reg.snapshot.backends
            assert (s.backend.id, s.migrating, s.health.reason) == (
                "llm/p", True, f"terminating ({SRC.name})")  # fmt: skip
            d.saw(SRC, {"llm/q": q})  # gone: removed; q, never ready, still out
            await settle()
            assert reg.backends == ()
        finally:
            applier.cancel()

    asyncio.run(go())
