"""`baton adapters ...`: the LoRA adapters clients may name, which backend holds each, and an
operator's loads and unloads (docs/routing.md#adapter-fleets)."""

# baton: pure

from __future__ import annotations

import argparse
import sys
from typing import Any

from clients import render
from clients.client import AdminClient
from clients.output import show


def cmd_list(args: argparse.Namespace, c: AdminClient) -> None:
    rows = c.adapters()
    show(args, rows, render.adapters(rows))


def cmd_load(args: argparse.Namespace, c: AdminClient) -> None:
    done: dict[str, Any] = c.load_adapter(args.name, args.backend or "", args.base or "",
                                          args.source or "")  # fmt: skip
    evicted = f" (unloaded {', '.join(done['evicted'])} first)" if done["evicted"] else ""
    said = (f"loaded {args.name} on {done['backend_id']} in {done['ms']:g} ms{evicted}"
            if done["ok"] else
            f"{args.name} did not load on {done['backend_id']}: {done['detail']}")  # fmt: skip
    show(args, done, said)
    if not done["ok"]:
        sys.exit(1)


def cmd_unload(args: argparse.Namespace, c: AdminClient) -> None:
    gone = c.unload_adapter(args.name, args.backend or "")
    where = ", ".join(gone) if gone else "nowhere (no backend held it)"
    show(args, {"unloaded_from": gone}, f"unloaded {args.name} from {where}")


def add_adapter_commands(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parent: argparse.ArgumentParser,
) -> None:
    adapters = sub.add_parser("adapters", help="LoRA adapters: where each is held, loads")
    asub = adapters.add_subparsers(dest="action", required=True)
    asub.add_parser("list", parents=[parent],
                    help="adapters clients may name, their base and who holds them"
                    ).set_defaults(admin=cmd_list)  # fmt: skip
    load = asub.add_parser("load", parents=[parent],
                           help="load an adapter on a backend (default: where placement "
                           "would), unloading the least recently used first if it is full")
    load.add_argument("name")
    load.add_argument("--backend", help="the backend to load it on")
    load.add_argument("--base", help="declare a new adapter: the model it applies to")
    load.add_argument("--source", help="declare a new adapter: where engines load it from "
                      "(a path on the engine's machine)")  # fmt: skip
    load.set_defaults(admin=cmd_load)
    unload = asub.add_parser("unload", parents=[parent],
                             help="unload an adapter (default: from every backend holding it)")
    unload.add_argument("name")
    unload.add_argument("--backend", help="only from this backend")
    unload.set_defaults(admin=cmd_unload)
