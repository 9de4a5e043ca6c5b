"""Prices changed at run time (issue 43), through real processes: a sim, control with a data
dir and a price in its config file, a shim, and the real CLI. A price set with `baton prices
set` is what requests are charged at (exactly the clients' usage, priced), and is still set
after control restarts; an unset one costs 0, says "no price", and stays unset across a
restart although the config file prices the model; bad input is refused and changes
nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from clients.procs import Part
from tests.integration.harness import MODEL, start_control, start_shim, start_sim, wait_until
from tests.integration.harness import write_config as write_fleet_config
from tests.integration.test_tenants import call

pytestmark = pytest.mark.timeout(120)

FILE_PRICE = f'[prices."{MODEL}"]\ninput = 1000\noutput = 2000\n'
INPUT, CACHED, OUTPUT = Decimal("2.5"), Decimal("1"), Decimal("10.000001")


def baton(control: Part, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.cli", *args, "--control",
                           control.ready], capture_output=True, text=True, timeout=30)  # fmt: skip


def ok(control: Part, *args: str) -> Any:
    out = baton(control, *args, "--json")
    assert out.returncode == 0, (args, out.stderr)
    return json.loads(out.stdout)


def usage(control: Part, tenant: str = "acme") -> tuple[Decimal, int]:
    """What `baton tenants usage` says the tenant's requests cost, and their prompt tokens."""
    (row,) = [u for u in ok(control, "tenants", "usage") if u["tenant"] == tenant]
    return Decimal(row["cost"]), row["prompt_tokens"]


def cost(control: Part) -> Decimal:
    return usage(control)[0]


def served(shim: Part, key: str, n: int) -> tuple[Decimal, int]:
    """`n` requests through `shim`: what their usage costs at INPUT/OUTPUT, and their prompt
    tokens."""
    total, prompt = Decimal(0), 0
    for i in range(n):
        status, body, _ = call(shim, key, max_tokens=5 + i, prompt=f"tell me {i} things")
        assert status == 200, body
        u = body["usage"]
        total += (u["prompt_tokens"] * INPUT + u["completion_tokens"] * OUTPUT) / 10**6
        prompt += u["prompt_tokens"]
    return total, prompt


def test_a_price_set_at_run_time_is_charged_kept_across_restarts_and_unset(
    tmp_path: Path,
) -> None:
    parts: list[Part] = []

    def up(*part: Part) -> Part:
        parts.extend(part)
        return part[-1]

    try:
        sim = up(start_sim())
        config = write_fleet_config(tmp_path / "control.toml", [("s0", sim.ready)],
                                    extra=FILE_PRICE)  # fmt: skip
        data = ("--data-dir", str(tmp_path / "data"))
        control = up(start_control(config, *data))
        key = ok(control, "tenants", "add", "acme")["key"]
        assert ok(control, "prices", "list")["prices"] == [
            {"model": MODEL, "input": "1000", "cached_input": "1000", "output": "2000"}
        ]
        said = ok(control, "prices", "set", MODEL, "--input", str(INPUT), "--output",
                  str(OUTPUT), "--cached-input", str(CACHED))  # fmt: skip
        want = {"model": MODEL, "input": "2.5", "cached_input": "1", "output": "10.000001"}
        assert said == want
        shim = up(start_shim(control.ready))
        assert wait_until(lambda: call(shim, key, max_tokens=1)[0] == 200, timeout=10)
        before = cost(control)
        charged, _ = served(shim, key, 4)
        assert wait_until(lambda: cost(control) == before + charged, timeout=5), (
            cost(control), before + charged)  # fmt: skip
        events = ok(control, "events", "--kind", "admin")
        assert [e.get("price") for e in events if e["action"] == "set-price"] == [
            "input=2.5 cached_input=1 output=10.000001"
        ]

        # Restarted: the price set at run time, not the file's, and charged at.
        control.stop()
        control = up(start_control(config, *data))
        assert ok(control, "prices", "list")["prices"] == [want]
        shim = up(start_shim(control.ready))
        assert wait_until(lambda: call(shim, key, max_tokens=1)[0] == 200, timeout=10)
        before = cost(control)
        charged, _ = served(shim, key, 3)
        assert wait_until(lambda: cost(control) == before + charged, timeout=5)

        # Unset: costs 0, and says so; still unset after a restart though the file prices it.
        assert ok(control, "prices", "unset", MODEL) == {"model": MODEL, "price": None}
        listed = ok(control, "prices", "list")
        assert listed == {"prices": [], "unpriced_models": [MODEL]}
        text = baton(control, "prices", "list").stdout
        assert MODEL in text and "no price (costs 0)" in text
        spent, tokens = usage(control)
        _, more = served(shim, key, 2)
        assert wait_until(lambda: usage(control)[1] == tokens + more, timeout=5)  # settled
        assert usage(control)[0] == spent  # at no price
        control.stop()
        control = up(start_control(config, *data))
        assert ok(control, "prices", "list") == listed
        again = baton(control, "prices", "unset", MODEL)
        assert again.returncode == 1 and "has no price" in again.stderr
    finally:
        for p in reversed(parts):
            p.stop()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ((MODEL, "--input=-1", "--output", "2"), "input must not be negative"),
        ((MODEL, "--input", "1", "--output", "nan"), "output must be finite"),
        ((MODEL, "--input", "1", "--output", "inf"), "output must be finite"),
        ((MODEL, "--input", "1", "--output", "2", "--cached-input", "0.0000001"),
         "cached_input has more than 6 decimals"),
        (("", "--input", "1", "--output", "2"), "model"),
    ],
)
def test_bad_prices_are_refused_and_change_nothing(
    fleet_control: Part, args: tuple[str, ...], said: str
) -> None:
    before = ok(fleet_control, "prices", "list"), ok(fleet_control, "events", "--kind", "admin")
    out = baton(fleet_control, "prices", "set", *args)
    assert out.returncode == 1, out.stdout
    assert "INVALID_ARGUMENT" in out.stderr and said in out.stderr, out.stderr
    after = ok(fleet_control, "prices", "list"), ok(fleet_control, "events", "--kind", "admin")
    assert after == before


@pytest.fixture(scope="module")
def fleet_control(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("prices")
    sim = start_sim()
    config = write_fleet_config(path / "control.toml", [("s0", sim.ready)], extra=FILE_PRICE)
    control = start_control(config, "--data-dir", str(path / "data"))
    try:
        yield control
    finally:
        control.stop()
        sim.stop()
