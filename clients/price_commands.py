"""`baton prices ...`: each model's price per million tokens (an adapter's under its own
name), changed at run time over control's config file (docs/tenants.md#budgets)."""

# baton: pure

from __future__ import annotations

import argparse
from typing import Any

from clients.client import AdminClient
from clients.output import show

COLUMNS = ("model", "input", "cached_input", "output")
NO_PRICE = "no price (costs 0)"


def table(listed: dict[str, Any]) -> str:
    """Priced models, then the served ones with no price, each saying it costs 0."""
    rows = [[str(p[c]) for c in COLUMNS] for p in listed["prices"]]
    rows += [[m, NO_PRICE, "", ""] for m in listed["unpriced_models"]]
    if not rows:
        return "no prices, and no models served"
    head = [c.upper() for c in COLUMNS]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
             for r in (head, *rows)]  # fmt: skip
    return "\n".join(lines) + "\n(per million tokens)"


def cmd_list(args: argparse.Namespace, c: AdminClient) -> None:
    listed = c.prices()
    show(args, listed, table(listed))


def cmd_set(args: argparse.Namespace, c: AdminClient) -> None:
    p = c.set_price(args.model, args.input, args.output, args.cached_input or "")
    show(args, p, f"{p['model']}: input {p['input']}, cached input {p['cached_input']}, "
                   f"output {p['output']} per million tokens")  # fmt: skip


def cmd_unset(args: argparse.Namespace, c: AdminClient) -> None:
    c.unset_price(args.model)
    show(args, {"model": args.model, "price": None}, f"{args.model}: {NO_PRICE}")


def add_price_commands(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parent: argparse.ArgumentParser,
) -> None:
    prices = sub.add_parser("prices", help="models' prices per million tokens (budgets' costs)")
    psub = prices.add_subparsers(dest="action", required=True)
    psub.add_parser("list", parents=[parent],
                    help="every model's price, and the models served with none (cost 0)"
                    ).set_defaults(admin=cmd_list)  # fmt: skip
    put = psub.add_parser("set", parents=[parent],
                          help="set a model's price (replaces the config file's), kept "
                          "across restarts")  # fmt: skip
    put.add_argument("model", help="the model's name as requests give it (an adapter's too)")
    put.add_argument("--input", required=True, help="per million input tokens, e.g. 3 or 0.15")
    put.add_argument("--output", required=True, help="per million output tokens")
    put.add_argument("--cached-input", help="per million cached input tokens (default: "
                     "the input price)")  # fmt: skip
    put.set_defaults(admin=cmd_set)
    unset = psub.add_parser("unset", parents=[parent],
                            help="remove a model's price (it costs 0), kept across restarts "
                            "even if the config file prices it")  # fmt: skip
    unset.add_argument("model")
    unset.set_defaults(admin=cmd_unset)
