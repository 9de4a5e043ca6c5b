"""Pure statistics for the benchmarks: percentiles, per-run stats, direct-vs-Baton summaries,
target checks and plain-text tables. No I/O, so every number printed is unit-testable."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median as _median
from typing import Any

NAN = float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks, the same
    rule as numpy's default, so numbers compare with other tools. NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return NAN
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    """Median ignoring NaN (a metric a rep could not measure must not poison the others)."""
    kept = [v for v in values if not math.isnan(v)]
    return _median(kept) if kept else NAN


@dataclass(frozen=True, slots=True)
class RunStats:
    """One closed-loop run (or the per-metric median of several)."""

    rps: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    errors: int
    completed: int
    # Per process name ("shim", "control", "sim", "loadgen"): CPU µs per completed request and
    # the fraction of one core used during the measurement window.
    cpu_us_per_req: Mapping[str, float] = field(default_factory=dict)
    cpu_util: Mapping[str, float] = field(default_factory=dict)
    # Streams: the SSE events the completed streams carried, and CPU µs per event.
    events: int = 0
    cpu_us_per_event: Mapping[str, float] = field(default_factory=dict)


def run_stats(raw: Mapping[str, Any]) -> RunStats:
    """Stats of one load-generator result (the JSON `bench.loadgen` prints)."""
    window = float(raw["window_s"])
    done = int(raw["ok_in_window"])
    cpu = {name: float(sec) for name, sec in raw["cpu_s"].items()}
    lat = raw["latency_ms"]
    ttft = raw["ttft_ms"]
    events = int(raw.get("events_in_window", 0))
    return RunStats(
        rps=done / window if window > 0 else NAN,
        p50_ms=percentile(lat, 50),
        p99_ms=percentile(lat, 99),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        errors=int(raw["errors"]),
        completed=done,
        cpu_us_per_req={k: v * 1e6 / done if done else NAN for k, v in cpu.items()},
        cpu_util={k: v / window if window > 0 else NAN for k, v in cpu.items()},
        events=events,
        cpu_us_per_event={k: v * 1e6 / events if events else NAN for k, v in cpu.items()},
    )


def median_stats(runs: Sequence[RunStats]) -> RunStats:
    """Per-metric median across reps; errors are summed, since every one of them matters."""

    def med(get: Callable[[RunStats], float]) -> float:
        return median(get(r) for r in runs)

    def med_map(get: Callable[[RunStats], Mapping[str, float]]) -> dict[str, float]:
        keys = sorted({k for r in runs for k in get(r)})
        return {k: median(get(r).get(k, NAN) for r in runs) for k in keys}

    return RunStats(
        rps=med(lambda r: r.rps),
        p50_ms=med(lambda r: r.p50_ms),
        p99_ms=med(lambda r: r.p99_ms),
        ttft_p50_ms=med(lambda r: r.ttft_p50_ms),
        ttft_p99_ms=med(lambda r: r.ttft_p99_ms),
        errors=sum(r.errors for r in runs),
        completed=sum(r.completed for r in runs),
        cpu_us_per_req=med_map(lambda r: r.cpu_us_per_req),
        cpu_util=med_map(lambda r: r.cpu_util),
        events=sum(r.events for r in runs),
        cpu_us_per_event=med_map(lambda r: r.cpu_us_per_event),
    )


@dataclass(frozen=True, slots=True)
class Cell:
    """One (mode, concurrency) row: the direct and Baton medians side by side.

    Added latencies are differences of the medians, so they match the columns printed next to
    them; runs alternate direct/Baton per rep so slow drift lands on both sides."""

    mode: str
    concurrency: int
    direct: RunStats
    baton: RunStats

    @property
    def ratio(self) -> float:
        return self.baton.rps / self.direct.rps if self.direct.rps > 0 else NAN

    @property
    def added_p50_ms(self) -> float:
        return self.baton.p50_ms - self.direct.p50_ms

    @property
    def added_ttft_p50_ms(self) -> float:
        return self.baton.ttft_p50_ms - self.direct.ttft_p50_ms


def summarize(raw_runs: Iterable[Mapping[str, Any]]) -> list[Cell]:
    """Group raw runs by (mode, concurrency, target); cells keep first-seen order."""
    groups: dict[tuple[str, int], dict[str, list[RunStats]]] = {}
    for raw in raw_runs:
        key = (str(raw["mode"]), int(raw["concurrency"]))
        groups.setdefault(key, {}).setdefault(str(raw["target"]), []).append(run_stats(raw))
    return [
        Cell(mode, conc, median_stats(t.get("direct", [])), median_stats(t.get("baton", [])))
        for (mode, conc), t in groups.items()
    ]


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: float  # NaN: not measured in this run
    limit: float
    higher_is_better: bool = False

    @property
    def verdict(self) -> str:
        if math.isnan(self.value):
            return "SKIP"
        ok = self.value >= self.limit if self.higher_is_better else self.value <= self.limit
        return "PASS" if ok else "FAIL"


def fmt(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns, first column left-aligned; a rule under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def write_json(path: Path, doc: Any) -> None:
    """A bench's raw numbers and summary, NaN written as null; says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(doc), allow_nan=False))
    print(f"\nwrote {path}")


def finite(value: Any) -> Any:
    """NaN (a metric not measured) becomes None, recursively: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def p50_p99(values: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def target_lines(ts: Iterable[Target]) -> list[str]:
    """One `PASS|FAIL|SKIP  name: value (op limit)` line per target."""
    return [
        f"{t.verdict}  {t.name}: {fmt(t.value, 3)} ({'>=' if t.higher_is_better else '<='} "
        f"{t.limit:g})"
        for t in ts
    ]


def ratio_to_best(values: Mapping[str, float]) -> dict[str, float]:
    """Each value over the smallest (lower is better); NaN where either is unmeasured, so a
    missing cell never becomes the best."""
    kept = [v for v in values.values() if not math.isnan(v)]
    best = min(kept) if kept else NAN
    return {k: v / best if best > 0 else NAN for k, v in values.items()}


def metric_sum(text: str, name: str) -> float:
    """A Prometheus text exposition's samples of `name`, summed over label sets; NaN when the
    metric is absent (not exported is not the same as zero)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else NAN


def rotated(items: Sequence[str], k: int) -> list[str]:
    """`items` starting at index k (mod len): run r of an interleaved benchmark starts with
    item r, so slow drift does not always land on the same item."""
    k = k % len(items) if items else 0
    return [*items[k:], *items[:k]]


def largest_share(values: Sequence[str]) -> float:
    """The fraction of `values` taken by its most common value (0 for none): how unevenly
    requests landed on backends."""
    if not values:
        return 0.0
    return max(values.count(v) for v in set(values)) / len(values)
