"""Spend budgets through real processes: sims, control with a priced model, two shims, the
tenant made with the real CLI, clients over HTTP and the official `openai` and `anthropic`
SDKs. A budget holds across both shims because control charges every request (its estimate
at admission, its engine's usage at its end); what control counts is exactly what the
engines' usage, priced, says the clients got."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from baton.tenancy import digest
from tests.integration.harness import (
    MODEL,
    control_metric,
    fleet,
    start_shim,
    start_sim,
    wait_until,
    write_config,
)
from tests.integration.test_tenants import Two, call

pytestmark = pytest.mark.timeout(180)

INPUT, OUTPUT = Decimal("1000"), Decimal("2000")  # per million tokens
PRICES = f'[prices."{MODEL}"]\ninput = {INPUT}\noutput = {OUTPUT}\n'
SLOWISH = ("--decode-ms-per-step", "5")  # 16 tokens: ~80 ms, so a flood overlaps
FLOOD = 8  # clients at once, four on each shim


@contextmanager
def two_shims(tmp_path: Path, sim_args: tuple[str, ...] = ()) -> Iterator[Two]:
    """test_tenants' two shims, with PRICES in control's config."""
    with fleet(tmp_path, 2, sim_args=sim_args, control_extra=PRICES) as f:
        second = start_shim(f.control.ready)
        f.parts.append(second)
        yield Two(f, (f.shim, second))


def cost(usage: dict[str, Any]) -> Decimal:
    """What the engine's usage costs at PRICES (the sims report no cached tokens)."""
    return (usage["prompt_tokens"] * INPUT + usage["completion_tokens"] * OUTPUT) / 10**6


def spend(two: Two, tenant: str) -> dict[str, Any]:
    """The tenant's first budget as `baton tenants usage --json` shows it."""
    out = two.fleet.baton("tenants", "usage", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = [u for u in json.loads(out.stdout) if u["tenant"] == tenant]
    return dict(row["budgets"][0]) | {"cost": row["cost"], "unpriced": row["unpriced_models"]}


def through(two: Two, key: str) -> Decimal:
    """Until both shims take the new key; what the calls that got through cost."""
    spent = [Decimal(0)]

    def taken(i: int) -> bool:
        status, body, _ = call(two.shims[i], key, max_tokens=1)
        if status == 200:
            spent[0] += cost(body["usage"])
        return status != 401

    for i in (0, 1):
        assert wait_until(lambda i=i: taken(i), timeout=10)
    return spent[0]


def test_a_budget_runs_out_mid_flood_across_two_shims(tmp_path: Path) -> None:
    with two_shims(tmp_path, SLOWISH) as two:
        key = two.tenant("acme", "--budget", "1/day")
        seen = [through(two, key)]  # what each 200 cost, as its client saw it
        lock = threading.Lock()
        refusals: list[tuple[dict[str, Any], dict[str, str]]] = []

        def client(i: int) -> None:
            for _ in range(200):
                status, body, headers = call(two.shims[i % 2], key, max_tokens=16)
                with lock:
                    if status != 200:
                        refusals.append((body, headers))
                        return
                    seen.append(cost(body["usage"]))

        flood = [threading.Thread(target=client, args=(i,)) for i in range(FLOOD)]
        for t in flood:
            t.start()
        for t in flood:
            t.join(timeout=120)
        assert len(refusals) == FLOOD, "every client of the flood ends refused"
        # The flood's own refusals came while others' requests were still in flight (their
        # estimates held); once they all ended, the budget is really spent: the next ones
        # are refused too, on both shims, and say until when.
        for i in range(4):
            status, body, headers = call(two.shims[i % 2], key, max_tokens=16)
            assert status == 429, body
            refusals.append((body, headers))
        midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        until_reset = (midnight + timedelta(days=1) - datetime.now(UTC)).total_seconds()
        for body, headers in refusals:
            assert body["error"]["code"] == "insufficient_quota", body
            assert body["error"]["type"] == "insufficient_quota", body
            assert "1.00 per day (UTC)" in body["error"]["message"], body
            assert headers["x-should-retry"] == "false"
            assert abs(int(headers["retry-after"]) - until_reset) <= 60, headers
        # Control's count is the clients' own, priced: exact, not a float near it.
        total = sum(seen, Decimal(0))
        standing = spend(two, "acme")
        assert Decimal(standing["spent"]) == total == Decimal(standing["cost"]), standing
        assert Decimal(standing["remaining"]) == 0 and Decimal(standing["in_flight"]) == 0
        assert standing["unpriced"] == []
        # Over by no more than what was in flight when it was reached: the flood's requests.
        in_flight = FLOOD * max(seen)
        overshoot = total - 1
        print(f"budget 1.00: spent {total} in {len(seen)} requests, over by {overshoot}; "
              f"in flight at most {FLOOD} x {max(seen)} = {in_flight}")  # fmt: skip
        assert 0 <= overshoot <= in_flight, (overshoot, in_flight)
        assert control_metric(two.fleet.control, "baton_tenant_budget_reached_total",
                              'kind="hard",period="day",tenant="acme"') == 1  # fmt: skip


def test_the_sdks_raise_their_own_errors_and_do_not_retry(tmp_path: Path) -> None:
    with two_shims(tmp_path) as two:
        key = two.tenant("acme", "--budget", "0.001/hour")  # one token's worth: spent at once
        through(two, key)
        assert wait_until(lambda: call(two.shims[0], key, max_tokens=1)[0] == 429, timeout=10)
        refused = lambda: control_metric(two.fleet.control, "baton_tenant_refused_total",  # noqa: E731
                                         'limit="budget",tenant="acme"')  # fmt: skip
        before = refused()
        # The SDK's default retries stay off: x-should-retry says a retry is refused too.
        sdk = openai.OpenAI(base_url=two.shims[1].ready + "/v1", api_key=key)
        with pytest.raises(openai.RateLimitError) as quota:
            sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert quota.value.code == "insufficient_quota"
        assert quota.value.type == "insufficient_quota"
        assert isinstance(quota.value.body, dict) and "0.001" in quota.value.body["message"]
        assert refused() == before + 1, "the SDK retried a refusal it was told not to"
        messages = anthropic.Anthropic(base_url=two.shims[0].ready, api_key=key)
        with pytest.raises(anthropic.BadRequestError) as limit:
            messages.messages.create(model=MODEL, max_tokens=4,
                                     messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        error = limit.value.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("You have reached your specified API usage limits.")
        next_hour = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%d at %H:00")
        assert f"You will regain access on {next_hour} UTC." in error["message"], error


def test_a_failover_mid_stream_is_charged_once(tmp_path: Path) -> None:
    # The tenant comes from the config (by its key's digest), so the stream is the fleet's
    # first request: round robin sends it to s0, which dies after 6 tokens.
    key = "sk-baton-" + "f" * 43
    tenant = (f'[[tenants]]\nid = "acme"\nkey_sha256 = ["{digest(key).hex()}"]\n'
              'budgets = [{amount = 100, period = "month", zone = "Europe/Berlin"}]\n')
    crash = ("--fault", "exit-after=6")
    with fleet(tmp_path, 2, per_sim=[crash], probe_interval=60,
               control_extra=tenant + PRICES) as f:  # fmt: skip
        sdk = openai.OpenAI(base_url=f.base_url, api_key=key, max_retries=0)
        usage, text = None, ""
        for ch in sdk.completions.create(model=MODEL, prompt="the quick brown fox", stream=True,
                                         max_tokens=30, temperature=0,
                                         stream_options={"include_usage": True}):  # fmt: skip
            text += ch.choices[0].text if ch.choices else ""
            usage = ch.usage or usage
        assert wait_until(lambda: not f.sims["s0"].alive, 10), "s0 never died mid-stream"
        events = json.loads(f.baton("events", "--kind", "failover", "--json").stdout)
        assert [e["outcome"] for e in events] == ["resumed"]
        assert usage is not None and usage.completion_tokens == 30
        charged = cost({"prompt_tokens": usage.prompt_tokens, "completion_tokens": 30})
        # One request, one charge over the whole generation (both engines' parts), on the
        # Berlin month's budget.
        assert wait_until(lambda: _spent(f.baton) == charged, timeout=10), _spent(f.baton)


def _spent(baton: Any) -> Decimal:
    out = baton("tenants", "usage", "--json")
    (row,) = json.loads(out.stdout)
    return Decimal(row["budgets"][0]["spent"])


def test_bad_input_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    sim = start_sim()
    try:
        bad = write_config(tmp_path / "bad.toml", [("s0", sim.ready)],
                           extra=f'[prices."{MODEL}"]\ninput = -1\noutput = 2\n')  # fmt: skip
        started = subprocess.run(
            [sys.executable, "-m", "control", "--config", str(bad), "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert started.returncode != 0
        assert f"price of '{MODEL}': input must not be negative" in started.stderr
    finally:
        sim.stop()
    with fleet(tmp_path, 1, control_extra=PRICES) as f:
        assert f.baton("tenants", "add", "acme", "--budget", "50/day").returncode == 0
        listed = f.baton("tenants", "list", "--json").stdout
        for args, said in (
            (("add", "other", "--budget", "50/fortnight"), "unknown period 'fortnight'"),
            (("update", "acme", "--budget", "50/day@Mars/Base"), "unknown time zone"),
            (("update", "acme", "--budget=-5/day"), "must not be negative"),
            (("update", "nobody", "--budget", "5/day"), "nobody"),
        ):
            out = f.baton("tenants", *args)
            assert out.returncode == 1, (args, out.stdout, out.stderr)
            assert said in out.stderr, (args, out.stderr)
        assert f.baton("tenants", "list", "--json").stdout == listed
        row = json.loads(listed)[0]
        assert row["budgets"] == ["50/day@UTC"]
        # And what is accepted shows: two budgets, one soft on a Berlin month.
        out = f.baton("tenants", "update", "acme", "--budget", "50/day",
                      "--budget", "1000/month@Europe/Berlin:soft")  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "50/day@UTC 1000/month@Europe/Berlin:soft" in out.stdout
        usage = f.baton("tenants", "usage").stdout
        assert "1000/month@Europe/Berlin:soft" in usage and "no price" not in usage
