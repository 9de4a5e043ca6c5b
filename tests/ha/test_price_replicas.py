"""Prices changed at run time on control replicas (issue 43): a price set, and one unset, on
the leader go to etcd in the configuration commit, so the replica that takes over after the
leader is killed has them (and charges requests at them), not the config file's."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.ha.group import group
from tests.integration.harness import MODEL, wait_until
from tests.integration.test_tenants import call

pytestmark = [pytest.mark.ha, pytest.mark.timeout(120)]

FILE = (f'[prices."{MODEL}"]\ninput = 1000\noutput = 2000\n'
        '[prices."lora-x"]\ninput = 1\noutput = 1\n')  # fmt: skip
INPUT, OUTPUT = Decimal("2.5"), Decimal("10.000001")


def test_a_price_set_on_the_leader_is_the_new_leaders_after_a_failover(tmp_path: Path) -> None:
    with group(tmp_path, replicas=2, sims=1, shims=1, extra=FILE) as g:
        old = g.wait_leader()

        def ok(*args: str) -> Any:
            out = g.baton(*args, "--json")
            assert out.returncode == 0, (args, out.stderr)
            return json.loads(out.stdout)

        ok("prices", "set", MODEL, "--input", str(INPUT), "--output", str(OUTPUT))
        ok("prices", "unset", "lora-x")
        key = ok("tenants", "add", "acme")["key"]
        listed = ok("prices", "list")
        assert listed["prices"] == [
            {"model": MODEL, "input": "2.5", "cached_input": "2.5", "output": "10.000001"}
        ]
        g.stop(old)
        new = g.wait_leader(not_=old)
        assert ok("prices", "list") == listed  # the file's prices are not back

        def cost() -> Decimal:
            (row,) = ok("tenants", "usage")
            return Decimal(row["cost"])

        assert g.followed(new)
        assert wait_until(lambda: call(g.shims[0], key, max_tokens=1)[0] == 200, timeout=10)
        before = cost()
        status, body, _ = call(g.shims[0], key, max_tokens=6)
        assert status == 200, body
        u = body["usage"]
        charged = (u["prompt_tokens"] * INPUT + u["completion_tokens"] * OUTPUT) / 10**6
        assert wait_until(lambda: cost() == before + charged, timeout=5), (cost(), before, charged)
