"""bench.overhead's numbers, from its raw load-generator runs to the printed table (pure: no I/O,
so every figure printed is unit-tested).

Each target's columns are medians over reps, each set against the direct run (the load sent
to one engine): added p50 latency at c=1, requests/s at c=16 and c=64 as a ratio to direct's,
added streaming TTFT at c=1, and the CPU time of all of the router's processes per request
(non-streamed, c=64) and per SSE event (64-token streams, c=64). Added latencies are
differences of the medians, so they match the direct row printed above them. Baton's own
columns are then stated over the aiohttp floor's, which is how issue 28 sets its targets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import stats

NAN = stats.NAN
DIRECT = "direct"
BATON = "Baton"
FLOOR = "aiohttp floor"
# The floor asking bench/floor_decider.py which engine, once per request: the least a router
# whose decisions one process makes for all its proxies (Baton's design) can cost.
DECIDED = "floor + decider"
# (mode, concurrency) of the runs each target gets, in the order they run within a rep.
CELLS = (("nonstream", 1), ("nonstream", 16), ("nonstream", 64), ("stream", 1), ("stream", 64))
BUSY = ("nonstream", 64)  # the cell whose cores' load the table shows


@dataclass(frozen=True, slots=True)
class Row:
    """One target's columns (medians over reps). For direct the latencies and rates are its
    own, absolute; for a router they are what it adds, or its ratio to direct."""

    target: str
    p50_ms: float  # non-streamed, c=1: added over direct's (direct's own for direct)
    rps_16: float  # non-streamed, c=16: ratio to direct's (direct's requests/s for direct)
    rps_64: float
    ttft_ms: float  # streamed, c=1: added over direct's (direct's own for direct)
    cpu_us_per_req: float  # all of the router's processes, non-streamed, c=64
    cpu_us_per_event: float  # all of the router's processes, streamed, c=64
    errors: int  # every error, every cell, every rep
    # The same two CPU figures per router process, where the router has more than one.
    cpu_us_per_req_by_part: Mapping[str, float] = field(default_factory=dict)
    cpu_us_per_event_by_part: Mapping[str, float] = field(default_factory=dict)
    # Fraction of one core the engines + load generator, and the router, kept busy (BUSY).
    engine_core_busy: float = NAN
    router_core_busy: float = NAN


def ratio(a: float, b: float) -> float:
    """a / b; NaN when either is unmeasured or b is not positive (a ratio to nothing)."""
    return a / b if b > 0 and not math.isnan(a) else NAN


def _router_cpu(raw: Mapping[str, Any], per: str) -> dict[str, float]:
    """CPU µs per request (`per` = "requests") or per event ("events") of each of the run's
    router processes, and their sum under "total"."""
    done = int(raw["ok_in_window"] if per == "requests" else raw.get("events_in_window", 0))
    cpu = raw["cpu_s"]
    parts = {p: float(cpu[p]) * 1e6 / done if done else NAN for p in raw["router_parts"]}
    return {**parts, "total": sum(parts.values()) if parts else NAN}


def _busy(raw: Mapping[str, Any], names: Iterable[str]) -> float:
    """Fraction of one core `names` used together in the window; NaN for no process."""
    window, names = float(raw["window_s"]), list(names)
    return sum(float(raw["cpu_s"][n]) for n in names) / window if window > 0 and names else NAN


def _median_of(
    runs: Sequence[Mapping[str, Any]], get: Callable[[Mapping[str, Any]], Mapping[str, float]]
) -> dict[str, float]:
    keys = sorted({k for r in runs for k in get(r)})
    return {k: stats.median(get(r).get(k, NAN) for r in runs) for k in keys}


def rows(raw_runs: Iterable[Mapping[str, Any]]) -> list[Row]:
    """One row per target, in first-seen order (direct's first when it ran)."""
    by: dict[str, dict[tuple[str, int], list[Mapping[str, Any]]]] = {}
    for raw in raw_runs:
        cell = (str(raw["mode"]), int(raw["concurrency"]))
        by.setdefault(str(raw["target"]), {}).setdefault(cell, []).append(raw)

    def cell_stats(target: str, cell: tuple[str, int]) -> stats.RunStats | None:
        runs = by.get(target, {}).get(cell)
        return stats.median_stats([stats.run_stats(r) for r in runs]) if runs else None

    def metric(target: str, cell: tuple[str, int], get: Callable[[stats.RunStats], float]) -> float:
        s = cell_stats(target, cell)
        return get(s) if s else NAN

    def p50(t: str) -> float:
        return metric(t, ("nonstream", 1), lambda s: s.p50_ms)

    def ttft(t: str) -> float:
        return metric(t, ("stream", 1), lambda s: s.ttft_p50_ms)

    def rps(t: str, conc: int) -> float:
        return metric(t, ("nonstream", conc), lambda s: s.rps)

    out = []
    for target, cells in by.items():
        heavy = cells.get(("nonstream", 64), [])
        streams = cells.get(("stream", 64), [])
        per_req = _median_of(heavy, lambda r: _router_cpu(r, "requests"))
        per_event = _median_of(streams, lambda r: _router_cpu(r, "events"))
        busy = cells.get(BUSY, [])
        router_parts = {p for r in busy for p in r["router_parts"]}
        engine_side = {n for r in busy for n in r["cpu_s"]} - router_parts
        direct = target == DIRECT
        out.append(Row(
            target=target,
            p50_ms=p50(target) if direct else p50(target) - p50(DIRECT),
            rps_16=rps(target, 16) if direct else ratio(rps(target, 16), rps(DIRECT, 16)),
            rps_64=rps(target, 64) if direct else ratio(rps(target, 64), rps(DIRECT, 64)),
            ttft_ms=ttft(target) if direct else ttft(target) - ttft(DIRECT),
            cpu_us_per_req=per_req.pop("total", NAN),
            cpu_us_per_event=per_event.pop("total", NAN),
            errors=sum(int(r["errors"]) for runs in cells.values() for r in runs),
            cpu_us_per_req_by_part=per_req if len(per_req) > 1 else {},
            cpu_us_per_event_by_part=per_event if len(per_event) > 1 else {},
            engine_core_busy=stats.median(_busy(r, engine_side) for r in busy),
            router_core_busy=stats.median(_busy(r, router_parts) for r in busy),
        ))  # fmt: skip
    return out


def checks(table: Sequence[Row]) -> list[stats.Target]:
    """Issue 28's targets, Baton over the floor; SKIP where either was not measured."""
    by = {r.target: r for r in table}
    none = Row("", NAN, NAN, NAN, NAN, NAN, NAN, 0)  # what was not measured
    baton, floor = by.get(BATON, none), by.get(FLOOR, none)
    shim = baton.cpu_us_per_req_by_part.get("shim", NAN)
    return [
        stats.Target("Baton/floor CPU per request, c=64",
                     ratio(baton.cpu_us_per_req, floor.cpu_us_per_req), 1.5),
        stats.Target("Baton/floor CPU per request, shim alone, c=64",
                     ratio(shim, floor.cpu_us_per_req), 1.25),
        stats.Target("Baton/floor added p50, c=1", ratio(baton.p50_ms, floor.p50_ms), 1.5),
        stats.Target("Baton/floor added TTFT, stream, c=1", ratio(baton.ttft_ms, floor.ttft_ms),
                     1.5),
        stats.Target("Baton/floor rps ratio, c=16", ratio(baton.rps_16, floor.rps_16), 0.8,
                     higher_is_better=True),
        stats.Target("Baton/floor rps ratio, c=64", ratio(baton.rps_64, floor.rps_64), 0.8,
                     higher_is_better=True),
        stats.Target("Baton/floor CPU per SSE event, c=64",
                     ratio(baton.cpu_us_per_event, floor.cpu_us_per_event), 1.5),
    ]  # fmt: skip


HEADERS = ("target", "+p50 c=1", "rps c=16", "rps c=64", "+TTFT c=1", "CPU us/req",
           "CPU us/event", "core busy e/r", "errors")  # fmt: skip


def _signed(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.2f} ms"


def _times(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _row_cells(r: Row) -> list[str]:
    busy = f"{stats.fmt(r.engine_core_busy)}/{stats.fmt(r.router_core_busy)}"
    if r.target == DIRECT:
        return [f"{DIRECT} (one engine)", f"{stats.fmt(r.p50_ms)} ms",
                f"{stats.fmt(r.rps_16, 0)}/s", f"{stats.fmt(r.rps_64, 0)}/s",
                f"{stats.fmt(r.ttft_ms)} ms", "-", "-", busy, str(r.errors)]  # fmt: skip
    return [r.target, _signed(r.p50_ms), _times(r.rps_16), _times(r.rps_64), _signed(r.ttft_ms),
            stats.fmt(r.cpu_us_per_req, 0), stats.fmt(r.cpu_us_per_event, 1), busy,
            str(r.errors)]  # fmt: skip


def render(table: Sequence[Row], not_run: Mapping[str, str]) -> str:
    """The side-by-side table (a router of several processes gets a line per process under
    it), a line per target that could not run, and Baton over the floor with its verdicts."""
    lines: list[list[str]] = []
    for r in table:
        lines.append(_row_cells(r))
        for part, us in r.cpu_us_per_req_by_part.items():
            per_event = r.cpu_us_per_event_by_part.get(part, NAN)
            lines.append([f"  {part}", "", "", "", "", stats.fmt(us, 0), stats.fmt(per_event, 1),
                          "", ""])  # fmt: skip
    text = [stats.render_table(HEADERS, lines)]
    text += [f"{name}  not run: {why}" for name, why in not_run.items()]
    text += [
        "",
        "direct: its own p50, requests/s and TTFT; routers: added ms, or requests/s as a ratio",
        "to direct's. CPU: user+system time of all of the router's processes over the window,",
        "per request (non-streamed, c=64) and per SSE event received (streamed, c=64). core",
        "busy: fraction of one core used at c=64 by engines + load generator / by the router.",
        "Medians over reps; errors summed over every run.",
        "",
        *stats.target_lines(checks(table)),
        *decided_lines(table),
    ]
    return "\n".join(text)


def decided_lines(table: Sequence[Row]) -> list[str]:
    """Baton over the floor that also asks a decision process each request (no target of
    the issue's; where Baton stands against the least its design can cost here)."""
    by = {r.target: r for r in table}
    baton, decided = by.get(BATON), by.get(DECIDED)
    if baton is None or decided is None:
        return []
    pairs = [
        ("CPU per request", baton.cpu_us_per_req, decided.cpu_us_per_req),
        ("added p50 c=1", baton.p50_ms, decided.p50_ms),
        ("added TTFT c=1", baton.ttft_ms, decided.ttft_ms),
        ("rps ratio c=16", baton.rps_16, decided.rps_16),
        ("rps ratio c=64", baton.rps_64, decided.rps_64),
        ("CPU per SSE event", baton.cpu_us_per_event, decided.cpu_us_per_event),
    ]
    shown = ", ".join(f"{name} {_times(ratio(b, d))}" for name, b, d in pairs)
    return ["", f"Baton over the {DECIDED} (no target; the floor of its design): {shown}"]
