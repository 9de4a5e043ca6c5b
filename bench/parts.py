"""How the benchmarks start Baton's parts: the model name, the argv of each part and the
control config, in one place so every benchmark measures the same system; and how they tell
that a started router serves."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from clients.procs import Part

MODEL = "toy"


def sim_argv(listen: str = "127.0.0.1:0", *extra: str) -> list[str]:
    return ["sim", "--listen", listen, "--model", MODEL, *extra]


def control_argv(config: str) -> list[str]:
    # Metrics on a free port: a benchmark must not collide with a running `baton up`.
    return ["control", "--config", config, "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0"]  # fmt: skip


def shim_argv(control: str) -> list[str]:
    return ["dataplane", "--control", control, "--listen", "127.0.0.1:0"]


def control_toml(
    backends: Mapping[str, str], *, routing: str | None = None,
    probe_interval: float | None = None,
) -> str:  # fmt: skip
    """`backends`: id -> base URL, all serving MODEL with the token path (kind vllm)."""
    head = f'routing = "{routing}"\n' if routing else ""
    if probe_interval is not None:
        head += f"[probes]\ninterval = {probe_interval}\n"
    tables = (
        f'[[backends]]\nid = "{bid}"\nurl = "{url}"\nmodel = "{MODEL}"\nkind = "vllm"\n'
        for bid, url in backends.items()
    )
    return "\n".join([head, *tables])


def serves_completion(base: str, model: str = MODEL, timeout: float = 5.0) -> bool:
    """Whether `base` answers a one-token completion with 200 now."""
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    req = urllib.request.Request(
        base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def starter(
    stack: contextlib.ExitStack, logdir: Path, prefix: str
) -> Callable[[str, list[str]], Part]:
    """start(name, argv): a Part whose stderr goes to logdir/PREFIX.NAME.log (a warning per
    request must not garble a table), stopped when `stack` closes."""

    def start(name: str, argv: list[str]) -> Part:
        log = stack.enter_context((logdir / f"{prefix}.{name}.log").open("wb"))
        part = Part(name, argv, stderr=log.fileno())
        stack.callback(part.stop, 3.0)
        return part

    return start
