"""`baton up`: control + one shim, and an embedded fleet of simulated engines when the
config lists no backends. Each part is its own process, as in production; this only
starts them, registers the sims through the admin API and stops everything on a signal."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from clients.client import AdminClient
from control import config as config_mod

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


class Child:
    """A started part; `ready` is the address it printed on its READY line."""

    def __init__(self, name: str, argv: list[str], timeout: float) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Ctrl-C reaches `baton up`, which stops children in order
        )
        self.ready = self._await_ready(timeout)

    def _await_ready(self, timeout: float) -> str:
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(self.proc.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(timeout)
        text = line[0].strip() if line else ""
        if " READY " not in text:
            self.stop()
            raise RuntimeError(f"{self.name} did not start (exit {self.proc.poll()}): {text!r}")
        return text.rsplit(" ", 1)[1]

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 2
    children: list[Child] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        control_argv = ["control", "--listen", args.control_listen]
        if args.config:
            control_argv += ["--config", str(args.config)]
        control = Child("control", control_argv, args.ready_timeout)
        children.append(control)
        if not cfg.backends:
            _start_fleet(args, control.ready, children)
        shim = Child(
            "shim",
            ["dataplane", "--control", control.ready, "--listen", args.listen],
            args.ready_timeout,
        )
        children.append(shim)
        print(
            f"Baton is up. OpenAI base URL: {shim.ready}/v1   (control: {control.ready})",
            flush=True,
        )
        print("Stop with Ctrl-C.", flush=True)
        while not stop.wait(0.5):
            dead = [c for c in (control, shim) if c.proc.poll() is not None]
            if dead:
                print(
                    f"baton up: {dead[0].name} exited ({dead[0].proc.returncode}); stopping",
                    file=sys.stderr,
                )
                return 1
        return 0
    except RuntimeError as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 1
    finally:
        # Front to back: no new requests reach the shim while engines go away.
        for child in reversed(children):
            child.stop()


def _start_fleet(args: argparse.Namespace, control: str, children: list[Child]) -> None:
    with AdminClient(control, token=os.environ.get("BATON_ADMIN_TOKEN")) as admin:
        for i in range(args.sim):
            sim = Child(
                f"sim-{i}",
                [
                    "sim",
                    "--listen",
                    "127.0.0.1:0",
                    "--model",
                    args.sim_model,
                    "--chip-seed",
                    str(i),
                ],
                args.ready_timeout,
            )
            children.append(sim)
            admin.add_backend(f"sim-{i}", sim.ready, args.sim_model, "vllm", "serve")
