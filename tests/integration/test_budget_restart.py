"""A tenant's spend survives control's SIGKILL (issue 43): control writes the spend the ledger
settled to fleet.db once a second, so a control killed after its last write comes back with
exactly the spend it had, and keeps enforcing the budget from there, not from zero."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    control_metric,
    start_control,
    start_shim,
    start_sim,
    wait_until,
    write_config,
)
from tests.integration.test_budgets import PRICES, cost
from tests.integration.test_tenants import call

pytestmark = pytest.mark.timeout(120)


def baton(control: Part, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "clients.cli", *args, "--control",
                          control.ready], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def usage(control: Part, tenant: str) -> dict[str, object]:
    """The tenant's first budget as `baton tenants usage --json` shows it."""
    (row,) = [u for u in json.loads(baton(control, "tenants", "usage", "--json"))
              if u["tenant"] == tenant]  # fmt: skip
    return dict(row["budgets"][0])


def test_spend_after_a_sigkill_of_control_equals_what_it_had_written(tmp_path: Path) -> None:
    config = write_config(tmp_path / "control.toml", [], extra=PRICES)
    data = ("--data-dir", str(tmp_path / "data"))
    parts: list[Part] = []
    try:
        sim = start_sim()
        parts.append(sim)
        control = start_control(config, *data)
        parts.append(control)
        baton(control, "backends", "add", "s0", "--url", sim.ready, "--model", MODEL)
        added = baton(control, "tenants", "add", "acme", "--budget", "1/day", "--json")
        key = json.loads(added)["key"]
        shim = start_shim(control.ready)
        parts.append(shim)
        assert wait_until(lambda: call(shim, key, max_tokens=1)[0] == 200, timeout=10)
        for _ in range(6):
            status, body, _ = call(shim, key, max_tokens=16)
            assert status == 200, body
        # What control counts: every call's usage, priced (the first ones above included).
        before = usage(control, "acme")
        spent = Decimal(str(before["spent"]))
        assert spent > 0 and before["in_flight"] in (0, "0", "0.00")
        # Written: nothing a crash could lose now.
        assert wait_until(lambda: control_metric(control, "baton_spend_unwritten") == 0, 10)
        control.kill()
        assert wait_until(lambda: not control.alive, 10)

        control = start_control(config, *data)
        parts.append(control)
        after = usage(control, "acme")
        assert Decimal(str(after["spent"])) == spent  # not zero: counted on from fleet.db
        assert after["resets"] == before["resets"]
        # And enforced from there: the rest of the budget, then a refusal.
        shim2 = start_shim(control.ready)
        parts.append(shim2)
        assert wait_until(lambda: call(shim2, key, max_tokens=1)[0] != 401, timeout=10)
        refused = None
        for _ in range(200):
            status, body, _ = call(shim2, key, max_tokens=16)
            if status == 429:
                refused = body
                break
            assert status == 200, body
            spent += cost(body["usage"])
        assert refused is not None and refused["error"]["code"] == "insufficient_quota"
        assert spent >= 1  # the budget ran out at 1.00, counting what came before the kill
    finally:
        for p in reversed(parts):
            p.stop()
