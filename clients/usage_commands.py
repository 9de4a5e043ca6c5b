"""`baton usage export` and `baton tenants usage --by day|model`: use per tenant, model and UTC
day (requests, tokens, cost) as control keeps it in fleet.db plus what it has not written yet
(docs/tenants.md#seeing-it). Costs stay decimal strings end to end: a sum here is a Decimal
sum, exact, as control's units are."""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any, TextIO

from clients import render
from clients.client import AdminClient, AdminError

EXPORT_COLUMNS = ("day", "tenant", "model", "requests", "prompt_tokens", "cached_tokens",
                  "completion_tokens", "cost")  # fmt: skip
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
BY = ("day", "model")


def when(flag: str, text: str, now: float) -> float:
    """A --since/--until value (5m, 2h, 1d ago, or an ISO 8601 time, UTC without a zone)."""
    try:
        return render.parse_since(text, now)
    except ValueError:
        raise AdminError(f"{flag} wants e.g. 5m, 2h, 7d or 2026-11-29T10:00:00, "
                         f"not {text!r}") from None  # fmt: skip


def by(rows: Iterable[Mapping[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows summed per tenant and `key` (day or model), in tenant then key order."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        k = (r["tenant"], r[key])
        acc = out.get(k)
        if acc is None:
            acc = out[k] = {"tenant": k[0], key: k[1], **dict.fromkeys(COUNTS, 0),
                            "cost": Decimal(0)}  # fmt: skip
        for c in COUNTS:
            acc[c] += r[c]
        acc["cost"] += Decimal(r["cost"])
    return [{**out[k], "cost": _text(out[k]["cost"])} for k in sorted(out)]


def _text(d: Decimal) -> str:
    text = format(d, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def show_by(args: argparse.Namespace, c: AdminClient) -> None:
    """`baton tenants usage --by day|model` (--since: the days it reaches; none: every day
    control kept)."""
    since = when("--since", args.since, time.time()) if args.since else None
    rows = by(c.usage_days(since), args.by)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no use recorded in that time")
    else:
        print(render.table([{**r, "cost": render_cost(r["cost"])} for r in rows],
                           ("tenant", args.by, *COUNTS, "cost")))  # fmt: skip


def render_cost(text: str) -> str:
    """At least 2 decimals, more only where they are not 0 (as `baton tenants usage`)."""
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


def write(rows: Iterable[Mapping[str, Any]], fmt: str, out: TextIO) -> int:
    """Rows as CSV (a header, then a line a row) or JSON lines; how many."""
    n = 0
    if fmt == "csv":
        w = csv.DictWriter(out, EXPORT_COLUMNS, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({c: r[c] for c in EXPORT_COLUMNS})
            n += 1
        return n
    for r in rows:
        out.write(json.dumps({c: r[c] for c in EXPORT_COLUMNS}) + "\n")
        n += 1
    return n


def cmd_export(args: argparse.Namespace, c: AdminClient) -> None:
    now = time.time()
    since = when("--since", args.since, now)
    until = when("--until", args.until, now) if args.until else None
    if until is not None and until <= since:
        raise AdminError("--until must be after --since")
    rows = c.usage_days(since, until)
    if args.output in ("", "-"):
        write(rows, args.format, sys.stdout)
        return
    with open(args.output, "w", newline="") as f:
        n = write(rows, args.format, f)
    print(f"{n} rows to {args.output}", file=sys.stderr)


def add_usage_commands(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parent: argparse.ArgumentParser,
) -> None:
    usage = sub.add_parser("usage", help="use and cost per tenant, model and UTC day")
    usub = usage.add_subparsers(dest="action", required=True)
    export = usub.add_parser("export", parents=[parent],
                             help="one row per tenant, model and UTC day: requests, tokens "
                             "(prompt, cached, completion) and cost")  # fmt: skip
    export.add_argument("--since", required=True,
                        help="7d, 12h, or an ISO 8601 time: the UTC days it reaches, whole")
    export.add_argument("--until", default="",
                        help="as --since; the days before it (default: up to now)")  # fmt: skip
    export.add_argument("--format", choices=("csv", "jsonl"), default="csv")
    export.add_argument("--output", "-o", default="", metavar="FILE",
                        help="write there (default: standard output)")  # fmt: skip
    export.set_defaults(admin=cmd_export)
