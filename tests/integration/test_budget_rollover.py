"""A budget's period ends and the tenant is served again (issue 43), through real processes:
control runs with its clock moved (BATON_CLOCK_OFFSET_S) to 25 s before the next
UTC hour, a tenant spends its hourly budget and is refused with the hour's end as its reset,
and once control's clock passes the hour the same key is served again from a fresh period."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import fleet, wait_until
from tests.integration.test_budgets import PRICES
from tests.integration.test_tenants import call

pytestmark = pytest.mark.timeout(120)

LEAD_S = 25.0  # control's clock starts this far before the hour: the setup's time, on a slow CI too


def test_an_hourly_budget_refuses_until_its_hour_ends_then_serves_again(tmp_path: Path) -> None:
    now = time.time()
    hour = (int(now) // 3600 + 1) * 3600
    offset = hour - LEAD_S - now
    with fleet(tmp_path, 1, control_extra=PRICES,
               control_env={"BATON_CLOCK_OFFSET_S": str(offset)}) as f:  # fmt: skip
        out = f.baton("tenants", "add", "acme", "--budget", "0.01/hour", "--json")
        assert out.returncode == 0, out.stderr
        key = json.loads(out.stdout)["key"]
        assert wait_until(lambda: call(f.shim, key, max_tokens=16)[0] != 401, timeout=10)
        refusal: tuple[dict[str, Any], dict[str, str], float] | None = None
        for _ in range(20):  # each costs over 0.01 at PRICES: the first one spends it
            status, body, headers = call(f.shim, key, max_tokens=16)
            if status == 429:
                refusal = (body, headers, time.time() + offset)
                break
            assert status == 200, body
        assert refusal is not None, "the hourly budget was never spent"
        body, headers, at = refusal
        assert body["error"]["code"] == body["error"]["type"] == "insufficient_quota"
        # The reset is the hour's end on control's clock, however far it is from this machine's.
        retry = float(headers["retry-after"])
        assert at < hour and abs(at + retry - hour) <= 2.0, (at, retry, hour)
        # The hour ends on control's clock: the same key is served from a fresh period.
        assert wait_until(lambda: call(f.shim, key, max_tokens=1)[0] == 200, timeout=LEAD_S + 10)
        assert time.time() + offset >= hour
        usage = json.loads(f.baton("tenants", "usage", "--json").stdout)
        (row,) = [u for u in usage if u["tenant"] == "acme"]
        budget = row["budgets"][0]
        assert float(budget["spent"]) < 0.01 + 0.1  # the new hour's spend only
