"""`python -m bench.budget_admission`: what budgets (issue 43) add to a request's admission,
in process, in µs per request, with and without, in one run:

- `route`: control's route decision (Router.route, timed alone; each request then ends,
  Router.finished, untimed),
  for a tenant with limits (concurrency, requests and tokens per minute), as bench.tenancy
  measures admission, the model priced; `route+budgets`: the same tenant with two budgets
  (50 a day in UTC, 1000 a month in Europe/Berlin), through the wiring itself (the tenant
  book's spend ledger: the estimate priced and admitted, the usage priced and settled).
- `book` and `book+budgets`: the same without the router: the tenant book's admission and
  end alone, with and without the spend ledger (less noise around the difference).
- the spend ledger alone, admission and end apart: the least noise; admission is what the
  issue bounds (at most 5 µs more per route decision).

The budgets are large enough never to refuse: every request takes the admission path. Each
figure is the best of `--reps` runs of `--decisions` requests, the runs of each pair
interleaved. Quote the differences: absolute times are this machine's."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from baton.budgets import Budget
from baton.pricing import PriceTable
from baton.spend import SpendLedger

MODEL = "bench-model"
PRICES = PriceTable.parse({MODEL: {"input": 3, "cached_input": "0.3", "output": 15}})
BUDGETS = (Budget.of(50_000_000, "day"), Budget.of(1_000_000_000, "month", "Europe/Berlin"))
START = 1_760_000_000.0  # a fixed instant: the same periods in every run


def _route_loop(budgets: bool, decisions: int) -> Callable[[], float]:
    """Control's route path as wired (issue 43): Router.route (admission through the tenant
    book, whose spend ledger prices the estimate and checks the tenant's budgets) and
    Router.finished (the usage priced and settled). Without budgets: the same tenant with
    none (the ledger's path is then a test of an empty tuple)."""
    from baton import model as m
    from baton.tenancy import Limits, Tenant, digest
    from control.fleet.registry import Registry
    from control.routing.policy import make_policy
    from control.routing.router import Router

    backends = [m.Backend(m.BackendId(f"b{i}"), f"http://127.0.0.1:{9000 + i}", MODEL,
                          m.BackendKind.VLLM, m.Role.SERVE) for i in range(4)]  # fmt: skip
    limits = Limits(concurrent=10_000, requests_per_minute=10**9, tokens_per_minute=10**12)
    tenant = Tenant("acme", limits=limits, budgets=BUDGETS if budgets else ())

    def run() -> float:
        ticks = iter(range(10**9)).__next__
        clock: Callable[[], float] = lambda: START + ticks() * 1e-4  # noqa: E731
        registry = Registry(backends, clock=clock, prices=PRICES)
        registry.tenants.add(tenant, digest("k"), now=START)
        router = Router(registry, make_policy("roundrobin"), clock=clock, route_events=False)
        shape = m.RequestShape(MODEL, prompt_chars=400, tenant="acme", max_tokens=64)
        requests = [m.RouteRequest(str(i), shape) for i in range(decisions)]
        ends = [[m.RequestOutcome(request_id=str(i), backend_id="b0", model=MODEL, ok=True,
                                  http_status=200, prompt_tokens=100, completion_tokens=64,
                                  tenant="acme")] for i in range(decisions)]  # fmt: skip
        spent = 0.0  # the route decisions' time alone: what the issue bounds
        for request, end in zip(requests, ends, strict=True):
            begin = time.perf_counter()
            decision = router.route(request)
            spent += time.perf_counter() - begin
            router.finished(end)
        assert decision.backends, decision  # admitted every time: the budgets never refuse
        return spent / decisions * 1e6

    return run


def _book_loop(budgets: bool, decisions: int) -> Callable[[], float]:
    from baton.tenancy import Limits, Tenant, digest
    from control.fleet.tenants import TenantBook

    limits = Limits(concurrent=10_000, requests_per_minute=10**9, tokens_per_minute=10**12)

    def run() -> float:
        book = TenantBook()
        book.add(Tenant("acme", limits=limits), digest("k"), now=START)
        spend = SpendLedger()
        begin = time.perf_counter()
        for i in range(decisions):
            rid, now = str(i), START + i * 1e-4
            book.admit(rid, "acme", MODEL, 164, now)
            if budgets:
                spend.admit(rid, "acme", BUDGETS, PRICES.estimate(MODEL, 100, 64), now)
            book.finished(rid, 100, 64, now)
            if budgets:
                spend.finished(rid, PRICES.cost(MODEL, 100, 0, 64), now)
        return (time.perf_counter() - begin) / decisions * 1e6

    return run


def _ledger_loop(part: str, decisions: int) -> Callable[[], float]:
    """The spend ledger alone: `empty` (the loop), `admit` (the estimate and the admission),
    `admit+end` (and the cost and the end)."""

    def run() -> float:
        spend = SpendLedger()
        begin = time.perf_counter()
        for i in range(decisions):
            rid, now = str(i), START + i * 1e-4
            if part != "empty":
                spend.admit(rid, "acme", BUDGETS, PRICES.estimate(MODEL, 100, 64), now)
            if part == "admit+end":
                spend.finished(rid, PRICES.cost(MODEL, 100, 0, 64), now)
        return (time.perf_counter() - begin) / decisions * 1e6

    return run


def measure(decisions: int = 20_000, reps: int = 5) -> dict[str, float]:
    """µs per request for each setup (best of `reps`), and the differences budgets make."""
    loops = {
        "route": _route_loop(False, decisions),
        "route+budgets": _route_loop(True, decisions),
        "book": _book_loop(False, decisions),
        "book+budgets": _book_loop(True, decisions),
        "empty": _ledger_loop("empty", decisions),
        "admit": _ledger_loop("admit", decisions),
        "admit+end": _ledger_loop("admit+end", decisions),
    }
    best = dict.fromkeys(loops, float("inf"))
    for _ in range(reps):
        for name, run in loops.items():  # interleaved: drift in the machine hits both sides
            best[name] = min(best[name], run())
    return {
        **{f"{name}_us": us for name, us in best.items()},
        "route_budgets_add_us": best["route+budgets"] - best["route"],
        "book_budgets_add_us": best["book+budgets"] - best["book"],
        "ledger_admission_us": best["admit"] - best["empty"],
        "ledger_end_us": best["admit+end"] - best["admit"],
    }


def report(r: dict[str, float]) -> str:
    return "\n".join([
        "| path | without budgets µs | with budgets µs | budgets add µs |",
        "|---|---|---|---|",
        f"| route decision | {r['route_us']:.2f} | {r['route+budgets_us']:.2f} | "
        f"{r['route_budgets_add_us']:.2f} |",
        f"| tenant book admit + end | {r['book_us']:.2f} | {r['book+budgets_us']:.2f} | "
        f"{r['book_budgets_add_us']:.2f} |",
        "",
        f"the budgets' own work: {r['ledger_admission_us']:.2f} µs at admission (the price "
        f"estimate and SpendLedger.admit), {r['ledger_end_us']:.2f} µs at the end (the cost "
        f"and SpendLedger.finished)",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.budget_admission", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--decisions", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = p.parse_args(argv)
    r = measure(args.decisions, args.reps)
    print(report(r))
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
