"""The `baton` command: run the parts (up, control, shim, sim) and administer the fleet."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from clients import render
from clients.adapter_commands import add_adapter_commands
from clients.client import DEFAULT_CONTROL, AdminClient, AdminError
from clients.output import show
from clients.price_commands import add_price_commands
from clients.tenant_commands import add_tenant_commands
from clients.usage_commands import add_usage_commands


def _admin_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--control",
        default=os.environ.get("BATON_CONTROL", DEFAULT_CONTROL),
        help="control plane HOST:PORT, or control replicas as HOST:PORT,HOST:PORT,... (calls go "
        "to the leader) (env BATON_CONTROL)",
    )
    parent.add_argument("--json", action="store_true", help="machine-readable output")
    parent.add_argument("--timeout", type=float, default=5.0, help="seconds per admin call")
    parent.add_argument(
        "--tls-ca",
        type=Path,
        default=os.environ.get("BATON_TLS_CA") or None,
        help="PEM CA of control's certificate: talk TLS (env BATON_TLS_CA)",
    )
    return parent


def cmd_backends_list(args: argparse.Namespace, c: AdminClient) -> None:
    rows = c.list_backends()
    show(args, [asdict(r) for r in rows], render.backends(rows))


def cmd_backends_add(args: argparse.Namespace, c: AdminClient) -> None:
    row = c.add_backend(
        args.id,
        args.url,
        args.model,
        args.kind,
        args.role,
        args.api_key_env,
        reasoning_parser=args.reasoning_parser,
        tool_parser=args.tool_parser,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        data_parallel_rank=args.data_parallel_rank,
    )
    show(args, asdict(row), f"added {row.id} ({row.model} at {row.url})")


def cmd_backends_remove(args: argparse.Namespace, c: AdminClient) -> None:
    c.remove_backend(args.id)
    show(args, {"removed": args.id}, f"removed {args.id}")


def cmd_backends_drain(args: argparse.Namespace, c: AdminClient) -> None:
    row = c.drain_backend(args.id, migrate=args.migrate)
    then = "in-flight streams move to other backends" if row.migrating else "in-flight ones finish"
    show(args, asdict(row), f"{row.id} is {row.state}: no new requests; {then}")


def cmd_backends_undrain(args: argparse.Namespace, c: AdminClient) -> None:
    row = c.undrain_backend(args.id)
    show(args, asdict(row), f"{row.id} is {row.state}")


def cmd_status(args: argparse.Namespace, c: AdminClient) -> None:
    s = c.status()
    show(args, s, render.status(s))


def cmd_events(args: argparse.Namespace, c: AdminClient) -> None:
    try:
        since = render.parse_since(args.since, time.time()) if args.since else None
    except ValueError as exc:
        raise AdminError(str(exc)) from None
    rows = c.events(
        kind=args.kind,
        request_id=args.request_id,
        backend_id=args.backend,
        since=since,
        limit=args.limit,
    )
    if args.follow:
        _follow(args, c, rows)
    elif args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(render.events(rows))


def _follow(args: argparse.Namespace, c: AdminClient, rows: list[dict[str, object]]) -> None:
    """What matched so far, then each new event as it happens: one JSON object or one table
    row per line, flushed, so it pipes into jq or grep."""

    def show(row: dict[str, object]) -> None:
        print(json.dumps(row) if args.json else render.event_line(row), flush=True)

    # An event recorded between the listing and the watch starting is missed; a watch that
    # replays from a sequence number would close that gap.
    for row in rows:
        show(row)
    try:
        for row in c.follow(kind=args.kind, request_id=args.request_id, backend_id=args.backend):
            show(row)
    except KeyboardInterrupt:
        pass


def cmd_pins_list(args: argparse.Namespace, c: AdminClient) -> None:
    rows, total = c.pins(backend_id=args.backend, limit=args.limit, kind=args.kind)
    if args.json:
        print(json.dumps({"total": total, "pins": rows}, indent=2))
    else:
        print(render.pins(rows, total))


def cmd_pins_clear(args: argparse.Namespace, c: AdminClient) -> None:
    cleared = c.clear_pins(args.backend)
    show(args, {"cleared": cleared}, f"cleared {cleared} pins")


def cmd_pairs_list(args: argparse.Namespace, c: AdminClient) -> None:
    rows = c.pairs()
    show(args, rows, render.pairs(rows))


def cmd_pairs_bind(args: argparse.Namespace, c: AdminClient) -> None:
    row = c.bind_pair(args.draft, args.target, args.num_draft_tokens)
    show(args, row, render.pairs([row]))


def cmd_pairs_unbind(args: argparse.Namespace, c: AdminClient) -> None:
    c.unbind_pair(args.id)
    show(args, {"unbound": args.id}, f"unbound {args.id}")


def _add_admin_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parent = _admin_parent()  # every admin command's connection and credential flags
    _add_backend_commands(sub, parent)
    sub.add_parser("status", parents=[parent], help="fleet summary").set_defaults(admin=cmd_status)
    _add_pin_and_pair_commands(sub, parent)
    add_tenant_commands(sub, parent)
    add_usage_commands(sub, parent)
    add_adapter_commands(sub, parent)
    add_price_commands(sub, parent)
    _add_event_command(sub, parent)


def _add_backend_commands(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parent: argparse.ArgumentParser,
) -> None:
    backends = sub.add_parser("backends", help="list and change the fleet's backends")
    bsub = backends.add_subparsers(dest="action", required=True)
    bsub.add_parser(
        "list", parents=[parent], help="backends with state, reason and load"
    ).set_defaults(admin=cmd_backends_list)
    add = bsub.add_parser("add", parents=[parent], help="register a backend")
    add.add_argument("id")
    add.add_argument("--url", required=True, help="http(s)://host:port of the engine")
    add.add_argument("--model", required=True, help="the model name the engine serves")
    add.add_argument("--kind", default="vllm", choices=("vllm", "sglang", "openai"))
    add.add_argument("--role", default="serve", choices=("serve", "draft", "target"))
    add.add_argument("--api-key-env", default="", metavar="VAR",
                     help="env var holding the backend's own API key (read by shims and control)")
    add.add_argument("--reasoning-parser", default="", metavar="NAME",
                     help="the engine's --reasoning-parser (e.g. deepseek_r1): shims keep the "
                     "reasoning/content split across a failover")
    add.add_argument("--tool-parser", default="", metavar="NAME",
                     help="the engine's --tool-call-parser (e.g. hermes): a stream with tools on "
                     "it is not resumed (an explicit error)")
    add.add_argument("--kv-events", default="", metavar="ENDPOINT",
                     help="the engine's KV-cache event socket (vLLM --kv-events-config "
                     "endpoint), tcp://HOST:PORT or ipc://PATH: control connects and keeps an "
                     "index of the prefix blocks it holds")
    add.add_argument("--kv-events-replay", default="", metavar="ENDPOINT",
                     help="its replay socket (replay_endpoint), to fetch batches control "
                     "missed; needs --kv-events")
    add.add_argument("--data-parallel-rank", type=int, default=None, metavar="R",
                     help="one rank of a data-parallel vLLM (--data-parallel-size; one API "
                     "server for every rank): its calls carry X-data-parallel-rank R, its load "
                     "is rank R's /metrics series and --kv-events rank R's stream")
    add.set_defaults(admin=cmd_backends_add)
    for name, fn, text in (
        ("remove", cmd_backends_remove, "unregister a backend"),
        ("drain", cmd_backends_drain, "stop sending new requests to a backend"),
        ("undrain", cmd_backends_undrain, "take a backend back into rotation"),
    ):
        p = bsub.add_parser(name, parents=[parent], help=text)
        p.add_argument("id")
        p.set_defaults(admin=fn)
        if name == "drain":
            p.add_argument(
                "--migrate",
                action="store_true",
                help="also hand its in-flight streams to other backends (resume protocol), "
                "e.g. to restart the engine for a deploy",
            )


def _add_pin_and_pair_commands(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parent: argparse.ArgumentParser,
) -> None:
    pins = sub.add_parser("pins", help="prefix-affinity and stored-response pins")
    psub = pins.add_subparsers(dest="action", required=True)
    plist = psub.add_parser("list", parents=[parent], help="most recently used first")
    plist.add_argument("--backend", default="")
    plist.add_argument("--kind", default="", choices=("", "prefix", "session", "response"),
                       help="prefix (KV-cache affinity), session (a client's session_id) or "
                       "response (who holds a stored response); default all")  # fmt: skip
    plist.add_argument("--limit", type=int, default=100)
    plist.set_defaults(admin=cmd_pins_list)
    pclear = psub.add_parser("clear", parents=[parent], help="forget pins (all, or one backend's)")
    pclear.add_argument("--backend", default="")
    pclear.set_defaults(admin=cmd_pins_clear)
    pairs = sub.add_parser("pairs", help="speculative-decoding pairs (draft -> target)")
    prsub = pairs.add_subparsers(dest="action", required=True)
    prsub.add_parser("list", parents=[parent], help="pairs with state and acceptance").set_defaults(
        admin=cmd_pairs_list
    )
    bind = prsub.add_parser(
        "bind", parents=[parent], help="bind a draft backend to a target (facts checked now)"
    )
    bind.add_argument("draft", help="the draft backend's id")
    bind.add_argument("target", help="the target backend's id")
    bind.add_argument("-k", "--num-draft-tokens", type=int, default=0, help="default 4")
    bind.set_defaults(admin=cmd_pairs_bind)
    unbind = prsub.add_parser("unbind", parents=[parent], help="remove a pair")
    unbind.add_argument("id")
    unbind.set_defaults(admin=cmd_pairs_unbind)


def _add_event_command(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    parent: argparse.ArgumentParser,
) -> None:
    ev = sub.add_parser("events", parents=[parent], help="the audit log (failovers, retries...)")
    ev.add_argument("--kind", default="", help="failover, retry, health, admin, pair, route")
    ev.add_argument("--request-id", default="")
    ev.add_argument("--backend", default="")
    ev.add_argument("--since", default="", help="5m, 2h, or an ISO 8601 time")
    ev.add_argument("--limit", type=int, default=1000)
    ev.add_argument("--follow", action="store_true", help="keep printing new events")
    ev.set_defaults(admin=cmd_events)


RUN_COMMANDS = (
    ("up", "clients.up", "control + shim (+ a simulated fleet when no backends are set)"),
    ("control", "control.__main__", "the control plane (gRPC)"),
    ("shim", "dataplane.__main__", "a data-plane shim (OpenAI API)"),
    ("sim", "sim.__main__", "a simulated vLLM-like engine"),
)


def _add_run_commands(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    wanted: str | None,
) -> None:
    """Only the part being run has its module imported (its flags): importing all four costs
    an admin command ~1.5 s of a start it does not need."""

    def runner(module: str) -> Callable[[argparse.Namespace], int]:
        def run(args: argparse.Namespace) -> int:
            return int(__import__(module, fromlist=["run"]).run(args))

        return run

    for name, module, text in RUN_COMMANDS:
        p = sub.add_parser(name, help=text)
        if name == wanted:
            __import__(module, fromlist=["add_arguments"]).add_arguments(p)
        p.set_defaults(run=runner(module))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """`argv`: the command line to be parsed (the part it runs, if any, gets its flags)."""
    words = sys.argv[1:] if argv is None else argv
    wanted = next((w for w in words if not w.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="baton", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_commands(sub, wanted)
    _add_admin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    if hasattr(args, "run"):
        return int(args.run(args))
    try:
        with AdminClient(args.control, timeout=args.timeout, tls_ca=args.tls_ca) as client:
            args.admin(args, client)
    except AdminError as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
