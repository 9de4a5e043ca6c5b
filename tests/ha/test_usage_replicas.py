"""Use per tenant, model and UTC day with control replicas (issue 43, docs/replicas.md): the
leader writes the day rows that changed to etcd a second at a time, so after every replica
is SIGKILLed and started again `baton usage export` still says exactly what the clients'
usage costs at the prices (Decimal, to the last digit), and today's rows count on from what
etcd held. Real processes: etcd 3.5, three control replicas, a shim, sims of two models."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from baton.pricing import amount
from control.replicas.etcd import Etcd
from control.replicas.usage import decode_day
from tests.ha.group import Group, group
from tests.integration.harness import start_control_replica, start_sim, wait_until
from tests.integration.test_tenants import call
from tests.integration.test_usage_export import CONFIG, COUNTS, M1, M2, as_expected, priced

pytestmark = [pytest.mark.ha, pytest.mark.timeout(180)]


def export(g: Group) -> list[dict[str, Any]]:
    out = g.baton("usage", "export", "--since", "1d", "--format", "jsonl")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def in_etcd(g: Group) -> dict[str, tuple[int, Decimal]]:
    """acme's (requests, cost) per model as etcd holds them (PREFIX/usage/...)."""

    async def read() -> dict[str, tuple[int, Decimal]]:
        client = Etcd(g.etcd.store_url.removeprefix("etcd://").split(","))
        try:
            kvs, _ = await client.get_prefix(b"/baton/usage/")
        finally:
            await client.close()
        rows = [decode_day(kv.value) for kv in kvs]
        return {r.model: (r.requests, amount(r.cost)) for r in rows
                if r.tenant_id == "acme"}  # fmt: skip

    return asyncio.run(read())


def restart_all(g: Group, tmp_path: Path, round_: int) -> None:
    """Every replica SIGKILLed, then started again on its port."""
    for rid in list(g.replicas):
        g.stop(rid)
    for rid, old in list(g.replicas.items()):
        g.replicas[rid] = start_control_replica(
            g.etcd, rid, config=g.config, port=int(old.ready.rsplit(":", 1)[1]),
            log=tmp_path / f"{rid}.again{round_}.log",
        )  # fmt: skip
        g.parts.append(g.replicas[rid])
    g.wait_leader()


def test_the_export_is_the_clients_usage_priced_after_every_replica_is_killed(
    tmp_path: Path,
) -> None:
    with group(tmp_path, sims=0, shims=1, extra=CONFIG) as g:
        for i, m in enumerate((M1, M2)):
            sim = start_sim(model=m)
            g.parts.append(sim)
            out = g.baton("backends", "add", f"s{i}", "--url", sim.ready, "--model", m)
            assert out.returncode == 0, out.stderr
        out = g.baton("tenants", "add", "acme", "--budget", "100/day", "--json")
        assert out.returncode == 0, out.stderr
        key, shim = str(json.loads(out.stdout)["key"]), g.shims[0]
        want: dict[str, dict[str, Any]] = defaultdict(
            lambda: {**dict.fromkeys(COUNTS, 0), "cost": Decimal(0)}
        )
        today = datetime.now(UTC).date().isoformat()

        def one(model: str, max_tokens: int, prompt: str = "hello there") -> int:
            status, body, _ = call(shim, key, model=model, max_tokens=max_tokens, prompt=prompt)
            if status == 200:
                u, w = body["usage"], want[model]
                w["requests"] += 1
                w["prompt_tokens"] += u["prompt_tokens"]
                w["completion_tokens"] += u["completion_tokens"]
                w["cost"] += priced(model, u)
            return status

        def expected() -> dict[str, dict[str, Any]]:
            return {m: {**w, "day": today} for m, w in want.items()}

        assert wait_until(lambda: one(M1, 1) == 200 and one(M2, 1) == 200, timeout=10)
        for n in range(6):
            assert one(M1, 5 + n, f"prompt number {n}") == 200
            assert one(M2, 20 + 3 * n, f"another {n} prompt") == 200
        assert wait_until(lambda: as_expected(export(g)) == expected(), 10)
        # Written within a second.
        written = {m: (w["requests"], w["cost"]) for m, w in want.items()}
        assert wait_until(lambda: in_etcd(g) == written, 10), (in_etcd(g), written)
        before = export(g)

        restart_all(g, tmp_path, 1)
        # Nothing in memory but today's rows, read back from etcd: the export is as before.
        assert export(g) == before
        assert as_expected(before) == expected()

        # Today's rows count on from what etcd held (a fresh count would say 1 request),
        # and that is written too: a second restart still has every request.
        assert wait_until(lambda: one(M1, 7, "after the restart") == 200, 10)
        assert wait_until(lambda: as_expected(export(g)) == expected(), 10)
        written = {m: (w["requests"], w["cost"]) for m, w in want.items()}
        assert wait_until(lambda: in_etcd(g) == written, 10), (in_etcd(g), written)
        restart_all(g, tmp_path, 2)
        assert as_expected(export(g)) == expected()
