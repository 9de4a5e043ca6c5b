"""bench/lora.py's fleets: sims run as `vllm serve --enable-lora`, control and one shim, set
up for each compared mode; the adapters' directories; the engines' load counter.

Modes (every one through the same control + shim, so each pays the same proxy):
- `baton`: Baton's adapter routing. Engines start holding no adapter, with runtime updating
  on; control is given one backend per replica (the base model) and the adapters in
  [[adapters]], and loads them where placement says.
- `roundrobin`, `adaptive`: adapter-blind, as an operator would run it today. Every engine
  registers every adapter at start (`--lora-modules`); control is given one backend per
  (replica, adapter) with `model = <adapter>` (same URL, distinct ids), no [[adapters]], and
  routes with that policy (adaptive is Baton's default).
- `hash`: each adapter always to one replica, chosen by rendezvous hashing of its name over
  the replica ids (the same hash Baton ranks with, so this is Baton's placement with a home
  set of one and no loads by control). Each engine registers the adapters hashed to it at
  start; control gets one backend per adapter, on its replica."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import stats
from bench.parts import MODEL, control_argv, serves_completion, shim_argv, sim_argv
from clients.client import AdminClient, AdminError
from clients.procs import Part
from control.routing.adapters import rank

MODES = ("baton", "roundrobin", "adaptive", "hash")
BLIND = ("roundrobin", "adaptive")
RUNTIME_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LOADS = "sim:lora_loads_total"


@dataclass(frozen=True, slots=True)
class Knobs:
    """Baton's [lora] table for the `baton` mode (control/settings.py LoraSettings)."""

    per_replica_rate: float = 8.0
    min_idle: float = 2.0
    saturated_at: int = 0
    half_life: float = 30.0
    refresh: float = 1.0

    def toml(self, max_adapters: int) -> str:
        return "\n".join(["[lora]", f"per_replica_rate = {self.per_replica_rate}",
                          f"min_idle = {self.min_idle}", f"saturated_at = {self.saturated_at}",
                          f"half_life = {self.half_life}", f"refresh = {self.refresh}",
                          f"max_adapters = {max_adapters}", ""])  # fmt: skip


@dataclass(frozen=True, slots=True)
class Setup:
    """The fleet's shape, the same for every mode."""

    replicas: int
    max_loras: int
    max_cpu_loras: int
    load_ms: float
    knobs: Knobs


def make_adapters(root: Path, names: Sequence[str]) -> dict[str, str]:
    """An adapter directory per name, as vLLM reads one (a PEFT config and weights); distinct
    bytes, so each adapter's output differs. name -> path."""
    out = {}
    for i, name in enumerate(names):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "adapter_config.json").write_text(
            json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
        )
        (d / "adapter_model.safetensors").write_bytes(bytes([i % 256]) * 128)
        out[name] = str(d)
    return out


def replica_ids(n: int) -> list[str]:
    return [f"s{i}" for i in range(n)]


def hashed_home(names: Sequence[str], replicas: Sequence[str]) -> dict[str, str]:
    """adapter -> the one replica `hash` sends it to."""
    return {a: rank(a, replicas)[0] for a in names}


def modules_for(mode: str, replica: str, adapters: Mapping[str, str],
                replicas: Sequence[str]) -> list[str]:  # fmt: skip
    """The adapters an engine registers at start (--lora-modules NAME=PATH ...)."""
    if mode == "baton":
        return []
    home = hashed_home(list(adapters), replicas) if mode == "hash" else None
    return [f"{a}={p}" for a, p in adapters.items() if home is None or home[a] == replica]


def sim_args(setup: Setup, modules: Sequence[str]) -> list[str]:
    """The sim's default timing (not --instant): TTFT includes a load's cost and the wait
    behind max_loras."""
    args = ["--enable-lora", "--max-loras", str(setup.max_loras), "--max-cpu-loras",
            str(setup.max_cpu_loras), "--lora-load-ms", f"{setup.load_ms:g}"]  # fmt: skip
    return [*args, "--lora-modules", *modules] if modules else args


def _backend(bid: str, url: str, model: str) -> str:
    return f'[[backends]]\nid = "{bid}"\nurl = "{url}"\nmodel = "{model}"\nkind = "vllm"\n'


def control_config(mode: str, setup: Setup, urls: Mapping[str, str],
                   adapters: Mapping[str, str]) -> str:  # fmt: skip
    """Control's TOML for `mode` over the sims at `urls` (replica id -> base URL)."""
    if mode == "baton":
        tables = [_backend(r, u, MODEL) for r, u in urls.items()]
        tables += [f'[[adapters]]\nname = "{a}"\nbase = "{MODEL}"\nsource = "{p}"\n'
                   for a, p in adapters.items()]  # fmt: skip
        # What Baton keeps loaded per engine: the engine's cache (--max-cpu-loras), of which
        # --max-loras run in one batch (docs/config.md [lora] max_adapters).
        return "\n".join([setup.knobs.toml(setup.max_cpu_loras), *tables])
    if mode in BLIND:
        pairs = [(r, a) for r in urls for a in adapters]
    elif mode == "hash":
        home = hashed_home(list(adapters), list(urls))
        pairs = [(home[a], a) for a in adapters]
    else:
        raise ValueError(f"unknown mode {mode!r}")
    policy = "roundrobin" if mode == "roundrobin" else "adaptive"
    tables = [_backend(f"{r}-{a}", urls[r], a) for r, a in pairs]
    return "\n".join([f'routing = "{policy}"\n', *tables])


@dataclass(frozen=True, slots=True)
class Fleet:
    base: str  # the shim: where clients send
    sims: tuple[str, ...]
    control: str


@contextlib.contextmanager
def running(
    mode: str, setup: Setup, adapters: Mapping[str, str], logdir: Path, tag: str
) -> Iterator[Fleet]:
    """Fresh sims, control and a shim for `mode`, serving when yielded; all stopped in reverse
    order on any exit, Ctrl-C included. Logs and config: logdir/lora.TAG.*"""
    logdir.mkdir(parents=True, exist_ok=True)
    reps = replica_ids(setup.replicas)
    with contextlib.ExitStack() as stack:

        def start(name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Part:
            # stderr to a file: a warning per request must not garble the table.
            log = stack.enter_context((logdir / f"lora.{tag}.{name}.log").open("wb"))
            part = Part(name, argv, stderr=log.fileno(), env=env)
            stack.callback(part.stop, 3.0)
            return part

        env = RUNTIME_ENV if mode == "baton" else None
        sims = {r: start(r, sim_argv("127.0.0.1:0", *sim_args(
            setup, modules_for(mode, r, adapters, reps))), env) for r in reps}  # fmt: skip
        config = logdir / f"lora.{tag}.control.toml"
        urls = {r: p.ready for r, p in sims.items()}
        config.write_text(control_config(mode, setup, urls, adapters))
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        await_ready(control.ready, shim.ready, mode, len(adapters))
        yield Fleet(shim.ready, tuple(urls.values()), control.ready)


def await_ready(control: str, shim: str, mode: str, n_adapters: int, timeout: float = 30) -> None:
    """Until control calls every backend healthy (in `baton` mode: known as an adapter engine,
    so a request for an adapter has somewhere to go) and the shim serves. Sends no request
    for an adapter: `baton` starts with no adapter loaded."""
    deadline = time.monotonic() + timeout
    with AdminClient(control, timeout=5.0) as admin:
        while not _backends_ready(admin, mode):
            if time.monotonic() > deadline:
                raise RuntimeError(f"control at {control}: backends not ready in {timeout}s")
            time.sleep(0.2)
    while not _shim_ready(shim, mode, n_adapters):
        if time.monotonic() > deadline:
            raise RuntimeError(f"shim at {shim} did not serve in {timeout}s")
        time.sleep(0.2)


def _backends_ready(admin: AdminClient, mode: str) -> bool:
    try:
        rows = admin.list_backends()
    except AdminError:
        return False
    if not rows or any(r.state != "healthy" for r in rows):
        return False
    return mode != "baton" or all(r.max_adapters > 0 for r in rows)


def _shim_ready(shim: str, mode: str, n_adapters: int) -> bool:
    if mode == "baton":
        return serves_completion(shim, MODEL)
    try:
        with urllib.request.urlopen(shim + "/v1/models", timeout=5) as resp:
            listed = json.loads(resp.read())["data"]
    except (OSError, ValueError):
        return False
    return len(listed) >= n_adapters


def engine_loads(sims: Sequence[str]) -> float:
    """sim:lora_loads_total summed over every sim (each load of adapter weights into an
    engine, reloads of an evicted adapter included)."""
    total = 0.0
    for url in sims:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            value = stats.metric_sum(resp.read().decode(), LOADS)
        total += 0.0 if math.isnan(value) else value  # NaN: no load yet on that sim
    return total


def adapter_events(control: str) -> dict[str, int]:
    """Control's adapter audit events counted by `action:reason` (load:home_load,
    load:fallback, unload:evict, found, ...), read through the real CLI: the loads Baton
    ordered, beside the engines' own count (which also has the reloads an engine's LRU made
    on its own)."""
    argv = [sys.executable, "-m", "clients.cli", "events", "--kind", "adapter", "--json",
            "--control", control, "--limit", "100000"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    found = Counter(f"{e['action']}:{e['reason']}" if e.get("reason") else str(e["action"])
                    for e in json.loads(out.stdout))  # fmt: skip
    return dict(sorted(found.items()))
