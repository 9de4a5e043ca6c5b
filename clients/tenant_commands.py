"""`baton tenants ...`: who may use the fleet, with what priority and within which limits
(docs/tenants.md). A key is printed once, when control makes it; lists name keys by key id."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from baton.budgets import Budget
from baton.tenancy import KEY_PREFIX, Priority, digest, key_id
from clients import render, usage_commands
from clients.client import AdminClient, AdminError, TenantSpec
from clients.output import show

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1


def _whole(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{value} is not in {minimum}..{maximum}")
        return value

    return parse


def _models(text: str | None) -> tuple[str, ...]:
    return tuple(sorted({m.strip() for m in (text or "").split(",") if m.strip()}))


def _budgets(texts: list[str] | None) -> tuple[Budget, ...]:
    """--budget values, checked here (an unknown period or zone says so, exit 1, and nothing
    is sent); control checks them again."""
    out: list[Budget] = []
    for text in texts or ():
        try:
            b = Budget.parse(text)
        except ValueError as exc:
            raise AdminError(f"--budget {text}: {exc}") from None
        if b in out:
            raise AdminError(f"--budget {text} is given twice")
        out.append(b)
    return tuple(out)


def _new_key(args: argparse.Namespace, tenant: dict[str, Any], key: str, said: str) -> None:
    """The one time a key is printed (with --json: its "key" field)."""
    kid = key_id(digest(key))
    show(args, {"tenant": tenant, "key": key, "key_id": kid},
          render.new_key(tenant, key, kid, said))  # fmt: skip


def cmd_list(args: argparse.Namespace, c: AdminClient) -> None:
    rows = c.tenants()
    show(args, rows, render.tenants(rows))


def cmd_add(args: argparse.Namespace, c: AdminClient) -> None:
    spec = TenantSpec(
        args.id,
        args.priority or Priority.STANDARD.value,
        1 if args.weight is None else args.weight,
        args.concurrent,
        args.rpm,
        args.tpm,
        _models(args.models),
        _budgets(args.budget),
    )
    tenant, key = c.add_tenant(spec)
    _new_key(args, tenant, key, f"added tenant {tenant['id']}")


def cmd_update(args: argparse.Namespace, c: AdminClient) -> None:
    """What the flags say over the tenant as it is now (read, then replaced whole: two
    operators updating one tenant at once, the last one's values win)."""
    changes: dict[str, Any] = {}
    for flag, field in (("priority", "priority"), ("weight", "weight"),
                        ("concurrent", "concurrent"), ("rpm", "requests_per_minute"),
                        ("tpm", "tokens_per_minute")):  # fmt: skip
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    for flag, field in (("no_concurrent", "concurrent"), ("no_rpm", "requests_per_minute"),
                        ("no_tpm", "tokens_per_minute")):  # fmt: skip
        if getattr(args, flag):
            changes[field] = None
    if args.models is not None or args.all_models:
        changes["models"] = _models(args.models)
    if args.budget is not None or args.no_budgets:
        changes["budgets"] = _budgets(args.budget)  # the tenant's budgets: these, or none
    if not changes:
        raise AdminError("nothing to change: give --priority, --weight, a limit, --no-LIMIT, "
                         "--all-models, --budget or --no-budgets")  # fmt: skip
    current = next((t for t in c.tenants() if t["id"] == args.id), None)
    # An unknown id is still sent: control answers NOT_FOUND in its own words.
    base = TenantSpec.of(current) if current is not None else TenantSpec(args.id)
    row = c.update_tenant(replace(base, **changes))
    show(args, row, f"updated tenant {row['id']}\n{render.tenants([row])}")


def cmd_remove(args: argparse.Namespace, c: AdminClient) -> None:
    c.remove_tenant(args.id)
    show(args, {"removed": args.id}, f"removed tenant {args.id}: its keys are refused now")


def cmd_key_add(args: argparse.Namespace, c: AdminClient) -> None:
    tenant, key = c.add_tenant_key(args.id)
    _new_key(args, tenant, key, f"added a key to tenant {tenant['id']} (its other keys stay "
             "valid until revoked)")  # fmt: skip


def cmd_key_revoke(args: argparse.Namespace, c: AdminClient) -> None:
    if args.key_id.startswith(KEY_PREFIX):
        # Not sent: a key goes nowhere but to its client.
        raise AdminError("that is a key, not a key id: give the KEYS column's id from "
                         "`baton tenants list`")  # fmt: skip
    row = c.revoke_tenant_key(args.id, args.key_id.lower())
    left = len(row["keys"])
    said = f"revoked key {args.key_id.lower()} of tenant {row['id']}; {left} left"
    if not left:
        said += f" (its clients are refused until `baton tenants keys add {row['id']}`)"
    show(args, row, said)


def cmd_usage(args: argparse.Namespace, c: AdminClient) -> None:
    if args.by:
        usage_commands.show_by(args, c)
        return
    try:
        since = render.parse_since(args.since, time.time()) if args.since else None
    except ValueError as exc:
        raise AdminError(str(exc)) from None
    rows = c.tenant_usage(since)
    show(args, rows, render.usage(rows))


def _config_flags(p: argparse.ArgumentParser, *, update: bool) -> None:
    p.add_argument("--priority", choices=[x.value for x in Priority], default=None,
                   help="its class when the fleet is saturated" +
                   ("" if update else " (default standard)"))  # fmt: skip
    p.add_argument("--weight", type=_whole(1, UINT32), default=None, metavar="N",
                   help="its share of its class" + ("" if update else " (default 1)"))  # fmt: skip
    limits = (("--concurrent", "no_concurrent", UINT32, "requests in flight at once"),
              ("--rpm", "no_rpm", UINT32, "requests per minute"),
              ("--tpm", "no_tpm", UINT64, "prompt + completion tokens per minute"))  # fmt: skip
    for flag, clear, top, text in limits:
        group = p.add_mutually_exclusive_group() if update else p
        # 0 is passed on: control refuses it, saying why (a limit is at least 1).
        group.add_argument(flag, type=_whole(0, top), default=None, metavar="N", help=text)
        if update:
            group.add_argument("--" + clear.replace("_", "-"), action="store_true",
                               help=f"no {flag[2:]} limit")  # fmt: skip
    models = p.add_mutually_exclusive_group() if update else p
    models.add_argument("--models", default=None, metavar="A,B",
                        help="the models it may use (default: every model)")  # fmt: skip
    if update:
        models.add_argument("--all-models", action="store_true", help="every model")
    budgets = p.add_mutually_exclusive_group() if update else p
    budgets.add_argument("--budget", action="append", default=None,
                         metavar="AMOUNT/PERIOD[@ZONE][:soft]",
                         help="a spend budget, repeatable: 50/day, 1000/month@Europe/Berlin, "
                         "40/week:soft (periods: hour, day, week, month; zone: UTC by default)"
                         + ("; replaces the tenant's budgets" if update else ""))  # fmt: skip
    if update:
        budgets.add_argument("--no-budgets", action="store_true", help="no spend budgets")


def add_tenant_commands(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parent: argparse.ArgumentParser,
) -> None:
    tenants = sub.add_parser("tenants", help="tenants: their keys, priority and limits")
    tsub = tenants.add_subparsers(dest="action", required=True)
    tsub.add_parser(
        "list", parents=[parent], help="tenants with priority, weight, limits and key ids"
    ).set_defaults(admin=cmd_list)
    add = tsub.add_parser("add", parents=[parent], help="add a tenant; prints its key once")
    add.add_argument("id")
    _config_flags(add, update=False)
    add.set_defaults(admin=cmd_add)
    update = tsub.add_parser("update", parents=[parent],
                             help="change a tenant's priority, weight or limits")  # fmt: skip
    update.add_argument("id")
    _config_flags(update, update=True)
    update.set_defaults(admin=cmd_update)
    remove = tsub.add_parser("remove", parents=[parent], help="remove a tenant and its keys")
    remove.add_argument("id")
    remove.set_defaults(admin=cmd_remove)
    usage = tsub.add_parser("usage", parents=[parent],
                            help="requests, tokens and refusals per tenant")  # fmt: skip
    usage.add_argument("--since", default="", help="5m, 2h, or an ISO 8601 time (default: "
                       "as far back as control keeps, 24 h at most, since it started; "
                       "with --by: every day kept)")  # fmt: skip
    usage.add_argument("--by", choices=usage_commands.BY, default=None,
                       help="per tenant and UTC day, or per tenant and model, with cost "
                       "(from fleet.db: as far back as it keeps)")  # fmt: skip
    usage.set_defaults(admin=cmd_usage)
    keys = tsub.add_parser("keys", help="a tenant's API keys (rotation: add, move, revoke)")
    ksub = keys.add_subparsers(dest="key_action", required=True)
    kadd = ksub.add_parser("add", parents=[parent], help="a new key; prints it once")
    kadd.add_argument("id", help="the tenant")
    kadd.set_defaults(admin=cmd_key_add)
    revoke = ksub.add_parser("revoke", parents=[parent], help="revoke one key by its id")
    revoke.add_argument("id", help="the tenant")
    revoke.add_argument("key_id", help="the key's id (KEYS in `baton tenants list`)")
    revoke.set_defaults(admin=cmd_key_revoke)
