"""Use per tenant, model and UTC day through real processes (issue 43, "seeing and exporting
it"): sims of two priced models, control with --data-dir, a tenant with budgets, requests
through a shim. `baton usage export` (csv and jsonl) and `baton tenants usage --by` say
exactly what the clients' own usage costs at the prices (Decimal, to the last digit); the
spend gauges on control's /metrics say it too; and after control is killed and started again
the export still has every row, from fleet.db."""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from clients.procs import Part
from tests.integration.harness import (
    cli,
    cli_json,
    control_metric,
    start_control,
    start_shim,
    start_sim,
    wait_until,
    write_config,
)
from tests.integration.test_tenants import call

pytestmark = pytest.mark.timeout(120)

M1, M2 = "toy", "toy-large"
# Per million tokens; odd digits so a rounding anywhere would show.
PRICES = {M1: (Decimal("1.25"), Decimal("0.125"), Decimal("10.000001")),
          M2: (Decimal("3.5"), Decimal("0.35"), Decimal("17.333333"))}  # fmt: skip
CONFIG = "".join(f'[prices."{m}"]\ninput = {i}\ncached_input = {c}\noutput = {o}\n'
                 for m, (i, c, o) in PRICES.items())  # fmt: skip
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def priced(model: str, usage: dict[str, Any]) -> Decimal:
    i, c, o = PRICES[model]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ((usage["prompt_tokens"] - cached) * i + cached * c
            + usage["completion_tokens"] * o) / 10**6  # fmt: skip


def export(control: Part, fmt: str) -> list[dict[str, Any]]:
    text = cli(control, "usage", "export", "--since", "1d", "--format", fmt)
    if fmt == "jsonl":
        return [json.loads(line) for line in text.splitlines()]
    return list(csv.DictReader(io.StringIO(text)))


def as_expected(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """acme's rows by model, counts as ints and cost as a Decimal (csv gives strings)."""
    out = {}
    for r in rows:
        assert r["tenant"] == "acme" and isinstance(r["cost"], str), r
        out[r["model"]] = {**{k: int(r[k]) for k in COUNTS}, "cost": Decimal(r["cost"]),
                           "day": r.get("day")}  # fmt: skip
    return out


def test_export_and_by_and_gauges_say_what_the_clients_got_priced(tmp_path: Path) -> None:
    config = write_config(tmp_path / "control.toml", [], extra=CONFIG)
    data = ("--data-dir", str(tmp_path / "data"))
    parts: list[Part] = []
    try:
        sims = {m: start_sim(model=m) for m in (M1, M2)}
        parts += sims.values()
        control = start_control(config, *data)
        parts.append(control)
        for i, (m, sim) in enumerate(sims.items()):
            cli(control, "backends", "add", f"s{i}", "--url", sim.ready, "--model", m)
        key = cli_json(control, "tenants", "add", "acme", "--budget", "100/day",
                       "--budget", "5000/month@Europe/Berlin")["key"]  # fmt: skip
        shim = start_shim(control.ready)
        parts.append(shim)
        want: dict[str, dict[str, Any]] = defaultdict(
            lambda: {**dict.fromkeys(COUNTS, 0), "cost": Decimal(0)})
        today = datetime.now(UTC).date().isoformat()

        def one(model: str, max_tokens: int, prompt: str = "hello there") -> int:
            status, body, _ = call(shim, key, model=model, max_tokens=max_tokens, prompt=prompt)
            if status == 200:
                u, w = body["usage"], want[model]
                w["requests"] += 1
                w["prompt_tokens"] += u["prompt_tokens"]
                w["cached_tokens"] += (u.get("prompt_tokens_details") or {}).get(
                    "cached_tokens") or 0  # fmt: skip
                w["completion_tokens"] += u["completion_tokens"]
                w["cost"] += priced(model, u)
            return status

        assert wait_until(lambda: one(M1, 1) == 200, timeout=10)  # the shim has the key
        for n in range(4):
            assert one(M1, 5 + n, f"prompt number {n}") == 200
            assert one(M2, 20 + 3 * n, f"another {n} prompt") == 200
        expected = {m: {**w, "day": today} for m, w in want.items()}
        for fmt in ("csv", "jsonl"):
            assert as_expected(export(control, fmt)) == expected, fmt
        by_model = cli_json(control, "tenants", "usage", "--by", "model")
        assert {r["model"]: {**{k: r[k] for k in COUNTS}, "cost": Decimal(r["cost"])}
                for r in by_model} == want  # fmt: skip
        (by_day,) = cli_json(control, "tenants", "usage", "--by", "day")
        total = sum((w["cost"] for w in want.values()), Decimal(0))
        assert by_day["day"] == today and Decimal(by_day["cost"]) == total
        assert by_day["requests"] == sum(w["requests"] for w in want.values())
        # The gauges, per budget period (floats: equal to the decimal to a float's precision).
        for period, budget in (("day:UTC", 100), ("month:Europe/Berlin", 5000)):
            labels = f'period="{period}",tenant="acme"'
            assert control_metric(control, "baton_tenant_spend", labels) == pytest.approx(
                float(total), rel=1e-12)  # fmt: skip
            left = control_metric(control, "baton_tenant_budget_remaining", labels)
            assert left == pytest.approx(float(budget - total), rel=1e-12)

        # Written within a second; then a SIGKILL, and the export comes from fleet.db.
        assert wait_until(lambda: control_metric(control, "baton_spend_unwritten") == 0, 10)
        rows_before = export(control, "jsonl")
        control.kill()
        assert wait_until(lambda: not control.alive, 10)
        control = start_control(config, *data)
        parts.append(control)
        assert export(control, "jsonl") == rows_before
        assert as_expected(export(control, "csv")) == expected
        # --until before today: none of today's rows.
        out = cli(control, "usage", "export", "--since", "3d", "--until", f"{today}T00:00:00",
                  "--format", "jsonl")  # fmt: skip
        assert out == ""
    finally:
        for p in reversed(parts):
            p.stop()
