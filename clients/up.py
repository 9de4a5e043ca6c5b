"""`baton up`: control + one shim, and an embedded fleet of simulated engines when the
config lists no backends. Each part is its own process, as in production; this only
starts them, registers the sims through the admin API and stops everything on a signal.

`--replicas N` (N > 1): a local etcd (clients/etcd_server.py) and N control replicas on it
(`--store etcd://...`, docs/replicas.md) in place of the one control; the shim and the
registrations follow whichever replica leads."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import tomllib
from collections.abc import Sequence
from pathlib import Path

from baton.tokens import ADMIN_ENV, SHIM_ENV
from clients.client import SHIM_TOKEN_FILE, TOKEN_FILE, AdminClient, AdminError
from clients.procs import Child, Part, StartFailed
from clients.up_replicas import register_with_leader, start_replicas

SIM_MODEL = "baton-sim"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="control config (TOML)")
    parser.add_argument("--listen", default="127.0.0.1:8000", help="shim HOST:PORT")
    parser.add_argument("--control-listen", default="127.0.0.1:50051", help="control HOST:PORT")
    parser.add_argument(
        "--sim",
        type=int,
        default=3,
        metavar="N",
        help="simulated engines to start when the config has no backends",
    )
    parser.add_argument("--sim-model", default=SIM_MODEL)
    parser.add_argument("--ready-timeout", type=float, default=30.0)
    parser.add_argument(
        "--data-dir",
        default=".baton",
        help="control's audit log and the admin token file ('' = memory, no token file)",
    )
    parser.add_argument(
        "--metrics-listen", default="127.0.0.1:9464", help="control's Prometheus HOST:PORT"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="N > 1: N control replicas on a local etcd (its data in DATA_DIR/etcd), on the "
        "first N consecutive free ports from --control-listen's (and --metrics-listen's)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        has_backends = _config_lists_backends(args.config)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        print(f"baton up: config {args.config}: {exc}", file=sys.stderr)
        return 2
    tokens = _tokens(args)
    if tokens is None:
        print("baton up: BATON_ADMIN_TOKEN and BATON_SHIM_TOKEN must differ", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("baton up: --replicas must be 1 or more", file=sys.stderr)
        return 2
    children: list[Child] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.replicas > 1:
            controls = start_replicas(args, has_backends, tokens, children)
        else:
            controls = [
                Part(
                    "control",
                    _control_argv(args, has_backends),
                    timeout=args.ready_timeout,
                    env=tokens,
                    die_with_parent=True,
                )
            ]
            children.append(controls[0])
        # Every part is started before this process opens a gRPC channel: a fork beside
        # gRPC's threads can abort in the child (seen once: "epoll_wait error: Bad file
        # descriptor", a sim's exit -6), and gRPC's threads outlive a closed channel.
        sims = _start_sims(args, children) if not has_backends else []
        control_at = ",".join(c.ready for c in controls)
        shim = Part(
            "shim",
            ["dataplane", "--control", control_at, "--listen", args.listen],
            timeout=args.ready_timeout,
            env={SHIM_ENV: tokens[SHIM_ENV]},
            die_with_parent=True,
        )
        children.append(shim)
        if sims and args.replicas > 1:
            register_with_leader(args, control_at, sims, tokens.get(ADMIN_ENV))
        elif sims:
            _register(args, control_at, sims, tokens.get(ADMIN_ENV))
        print(
            f"Baton is up. OpenAI base URL: {shim.ready}/v1   (control: {control_at})",
            flush=True,
        )
        print("Stop with Ctrl-C.", flush=True)
        if args.replicas > 1:
            return _watch(stop, (children[0], shim), replicas=controls)
        return _watch(stop, (controls[0], shim))
    except (StartFailed, AdminError) as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 1
    finally:
        # Front to back: no new requests reach the shim while engines go away.
        for child in reversed(children):
            child.stop()


def _tokens(args: argparse.Namespace) -> dict[str, str] | None:
    """The environment that gives control (and the shim) their tokens, never a command line
    (ps shows those). Shims present a token of their own to the routing service; without a
    data dir it lives only in this process's children. None: the two are the same."""
    token = os.environ.get(ADMIN_ENV)
    shim_token = os.environ.get(SHIM_ENV)
    if args.data_dir:
        token = token or ensure_token_file(Path(args.data_dir))
        shim_token = shim_token or ensure_token_file(Path(args.data_dir), SHIM_TOKEN_FILE)
    shim_token = shim_token or secrets.token_urlsafe(24)
    if token == shim_token:
        return None
    return {SHIM_ENV: shim_token, **({ADMIN_ENV: token} if token else {})}


def _control_argv(args: argparse.Namespace, has_backends: bool) -> list[str]:
    argv = ["control", "--listen", args.control_listen, "--metrics-listen", args.metrics_listen]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    if args.config:
        argv += ["--config", str(args.config)]
    if not has_backends:
        # The embedded sims are registered anew at every start (new ports): not
        # operator configuration, so not saved, and no saved copy collides with them.
        argv.append("--no-fleet-db")
    return argv


def _watch(stop: threading.Event, parts: Sequence[Child], replicas: Sequence[Part] = ()) -> int:
    """Until a stop signal (0), or until a part exits on its own (1). A control replica's
    exit is told, not fatal while another is left: killing the leader to watch another
    take over is what replicas are for."""
    gone: set[str] = set()
    while not stop.wait(0.5):
        dead = [c for c in parts if not c.alive]
        for r in replicas:
            if not r.alive and r.name not in gone:
                gone.add(r.name)
                left = len(replicas) - len(gone)
                print(
                    f"baton up: {r.name} exited ({r.returncode}); {left} replica(s) left",
                    file=sys.stderr,
                )
        if replicas and len(gone) == len(replicas):
            dead.append(replicas[-1])
        if dead:
            print(
                f"baton up: {dead[0].name} exited ({dead[0].returncode}); stopping",
                file=sys.stderr,
            )
            return 1
    return 0


def _config_lists_backends(path: Path | None) -> bool:
    """Whether to start the embedded sims. The rest of the file is control's to validate
    (it refuses a bad one at start, with the reason, and baton up stops with it)."""
    if path is None:
        return False
    with open(path, "rb") as f:
        return bool(tomllib.load(f).get("backends"))


def ensure_token_file(data_dir: Path, name: str = TOKEN_FILE) -> str:
    """A token `baton up` gives control (the admin token; the shim token), kept (0600) where
    the CLI, or a shim started by hand, finds it; the same at every start."""
    path = data_dir / name
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _start_sims(args: argparse.Namespace, children: list[Child]) -> list[Part]:
    sims = []
    for i in range(args.sim):
        sim = Part(
            f"sim-{i}",
            ["sim", "--listen", "127.0.0.1:0", "--model", args.sim_model, "--chip-seed", str(i)],
            timeout=args.ready_timeout,
            die_with_parent=True,
        )
        children.append(sim)
        sims.append(sim)
    return sims


def _register(
    args: argparse.Namespace, control: str, sims: list[Part], token: str | None
) -> None:
    with AdminClient(control, token=token or "") as admin:
        for i, sim in enumerate(sims):
            admin.add_backend(f"sim-{i}", sim.ready, args.sim_model, "vllm", "serve")
