"""Real processes on 127.0.0.1 with free ports: sims, control, shims. Every wait is bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

from clients.etcd_server import EtcdServer
from clients.procs import Part, free_port

MODEL = "toy"
# The sim's cost model zeroed: tests measure behaviour, not speed.
FAST_SIM = ("--prefill-us-per-token", "0", "--decode-ms-per-step", "0")


def start_sim(*extra: str, model: str = MODEL) -> Part:
    return Part("sim", ["sim", "--listen", "127.0.0.1:0", "--model", model, *FAST_SIM, *extra])


def start_sims(flags: Sequence[Sequence[str]], model: str = MODEL) -> list[Part]:
    """One sim per entry of `flags` (its extra flags), started at once rather than one after
    the other (a start is mostly its interpreter's imports); all or none: if one does not
    start, those that did are stopped."""
    return start_all([lambda extra=tuple(f): start_sim(*extra, model=model) for f in flags])


def start_all(starts: Sequence[Callable[[], Part]]) -> list[Part]:
    """Run each start at once, each waiting for its own part's READY line; the parts in the
    order of `starts`. All or none: if one fails, those that started are stopped."""
    if len(starts) <= 1:
        return [s() for s in starts]
    with ThreadPoolExecutor(max_workers=len(starts)) as pool:
        futures = [pool.submit(s) for s in starts]
    parts, failure = [], None
    for fut in futures:
        try:
            parts.append(fut.result())
        except BaseException as e:  # re-raised below, once the others are stopped
            failure = failure or e
    if failure is not None:
        stop_all(parts)
        raise failure
    return parts


def stop_all(parts: Sequence[Part], grace: float = 3) -> None:
    """Stop parts in reverse order (each gets SIGTERM once the one after it has exited)."""
    for p in reversed(parts):
        p.stop(grace=grace)


def write_config(
    path: Path,
    backends: Sequence[tuple[str, str]],
    model: str = MODEL,
    extra: str = "",
    probe_interval: float = 0.2,
    kind: str = "vllm",
    backend_extra: str = "",
) -> Path:
    """`backend_extra`: TOML lines added to every [[backends]] table."""
    lines = [extra, "[probes]", f"interval = {probe_interval}", "timeout = 0.5", ""]
    for bid, url in backends:
        lines += [
            "[[backends]]",
            f'id = "{bid}"',
            f'url = "{url}"',
            f'model = "{model}"',
            f'kind = "{kind}"',
            backend_extra,
            "",
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def start_control(
    config: Path, *extra: str, env: dict[str, str] | None = None, log: Path | None = None
) -> Part:
    """`log`: a file that gets control's log, at INFO (by default it goes, at WARNING, to
    the test's stderr)."""
    argv = ["control", "--config", str(config), "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0"]  # fmt: skip
    return _start("control", argv, extra, env, log)


def start_shim(
    control: str, *extra: str, env: dict[str, str] | None = None, log: Path | None = None
) -> Part:
    """`log`: as start_control's."""
    argv = ["dataplane", "--control", control, "--listen", "127.0.0.1:0"]
    return _start("shim", argv, extra, env, log)


def start_etcd(tmp_path: Path, *, die_with_parent: bool = False) -> EtcdServer:
    """A single-member etcd on free ports, its data under tmp_path/etcd, started: timings
    for fast leases (etcd grants 1 s). The caller stops it; kill() and restart() play a crash
    and a recovery with the same data and ports."""
    return EtcdServer(tmp_path / "etcd", die_with_parent=die_with_parent).start()


def start_control_replica(
    etcd: EtcdServer | str,
    replica_id: str,
    *extra: str,
    config: Path | None = None,
    port: int = 0,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> Part:
    """One control replica on `etcd` (an EtcdServer, or a `--store` URL), as start_control
    starts a control. It listens on `port` (0: a free one), told as such rather than port 0,
    since what it listens on is what it advertises to shims and the other replicas; a
    restarted replica takes its old port back. `log`: as start_control's."""
    store = etcd.store_url if isinstance(etcd, EtcdServer) else etcd
    argv = ["control", "--listen", f"127.0.0.1:{port or free_port()}", "--metrics-listen",
            "127.0.0.1:0", "--store", store, "--replica-id", replica_id]  # fmt: skip
    if config is not None:
        argv += ["--config", str(config)]
    return _start(replica_id, argv, extra, env, log)


def start_control_replicas(
    n: int,
    etcd: EtcdServer | str,
    *extra: str,
    config: Path | None = None,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
) -> list[Part]:
    """Replicas c0..c{n-1} (start_control_replica), started one after the other; whichever
    takes etcd's lease first leads (c0, unless it is slow), and nothing here waits for that.
    `log_dir`: each replica logs to log_dir/cI.log. If one does not start, the ones started
    are stopped."""
    parts: list[Part] = []
    try:
        for i in range(n):
            log = log_dir / f"c{i}.log" if log_dir is not None else None
            parts.append(
                start_control_replica(etcd, f"c{i}", *extra, config=config, env=env, log=log)
            )
    except BaseException:
        for p in reversed(parts):
            p.stop(grace=3)
        raise
    return parts


def _start(
    name: str,
    argv: list[str],
    extra: Sequence[str],
    env: dict[str, str] | None,
    log: Path | None,
) -> Part:
    if log is None:
        return Part(name, [*argv, *extra], env=env)
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return Part(name, [*argv, "--log-level", "INFO", *extra], env=env, stderr=out.fileno())


def cli(control: Part, *args: str) -> str:
    """Run the real CLI against `control`; what it printed (it must succeed)."""
    import os

    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", *args, "--control", control.ready],
        capture_output=True, text=True, timeout=30, env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 0, (args, out.stderr)
    return out.stdout


def cli_json(control: Part, *args: str) -> Any:
    """Run the real CLI with --json against `control`; its parsed output (it must succeed)."""
    return json.loads(cli(control, *args, "--json"))


@dataclass
class Fleet:
    sims: dict[str, Part]
    control: Part
    shim: Part
    parts: list[Part] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.shim.ready + "/v1"

    def baton(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the real CLI against this fleet's control plane."""
        import os

        return subprocess.run(
            [sys.executable, "-m", "clients.cli", *args, "--control", self.control.ready],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **(env or {})},
        )

    def backends(self) -> dict[str, dict[str, object]]:
        out = self.baton("backends", "list", "--json")
        assert out.returncode == 0, out.stderr
        return {row["id"]: row for row in json.loads(out.stdout)}


@contextmanager
def fleet(
    tmp_path: Path,
    n: int = 2,
    *,
    sim_args: Sequence[str] = (),
    shim_args: Sequence[str] = (),
    control_env: dict[str, str] | None = None,
    probe_interval: float = 0.2,
    per_sim: Sequence[Sequence[str]] = (),
    kind: str = "vllm",
    control_extra: str = "",
    shim_env: dict[str, str] | None = None,
    backend_extra: str = "",
    control_args: Sequence[str] = (),
) -> Iterator[Fleet]:
    """n sims s0..s{n-1} (per_sim[i] adds flags to sim i), control, one shim. Round robin
    sends a fresh fleet's first request to s0."""
    parts: list[Part] = []
    try:
        flags = [(*sim_args, *(per_sim[i] if i < len(per_sim) else ())) for i in range(n)]
        sims = {f"s{i}": p for i, p in enumerate(start_sims(flags))}
        parts += sims.values()
        config = write_config(
            tmp_path / "control.toml",
            [(k, p.ready) for k, p in sims.items()],
            probe_interval=probe_interval,
            kind=kind,
            extra=control_extra,
            backend_extra=backend_extra,
        )
        control = start_control(config, *control_args, env=control_env)
        parts.append(control)
        shim = start_shim(control.ready, *shim_args, env=shim_env)
        parts.append(shim)
        yield Fleet(sims, control, shim, parts)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    status, data, _ = http_full(method, url, body, headers)
    return status, data


def http_full(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def _samples(text: str, name: str, labels: str) -> list[float]:
    """The values of `name`'s samples whose label set contains `labels`."""
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
        and labels in line
    ]  # fmt: skip


def metric(base: str, name: str, labels: str = "") -> float:
    """One sample from a sim's Prometheus /metrics (summed over label sets matching `labels`)."""
    _, text = http("GET", base + "/metrics")
    found = _samples(text.decode(), name, labels)
    assert found, f"metric {name}{{{labels}}} not exported"
    return sum(found)


def control_metric(control: Part, name: str, labels: str = "") -> float:
    """A sum over one of control's series (its --metrics-listen, as it announced it), over
    the label sets matching `labels`; 0 before its first sample."""
    _, text = http("GET", control.announced["METRICS"])
    return sum(_samples(text.decode(), name, labels))


PROMPT = "the quick brown fox"


@dataclass
class Streamed:
    """What a client saw of one streamed completion."""

    max_tokens: int
    status: int
    text: str = ""
    finish: str | None = None
    done: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


def stream(base: str, max_tokens: int, prompt: str = PROMPT) -> Streamed:
    """One greedy streaming completion of the toy model over plain HTTP: every event checked,
    nothing assumed."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        out = Streamed(max_tokens, resp.status)
        if resp.status != 200:
            out.error = resp.read().decode()
            return out
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                out.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                out.error = json.dumps(event["error"])
                continue
            for choice in event.get("choices") or []:
                out.text += choice.get("text") or ""
                out.finish = choice.get("finish_reason") or out.finish
        return out
    finally:
        conn.close()


def wait_until(check: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


def once_key_taken(call: Callable[[], object], timeout: float = 10.0) -> bool:
    """Calls `call` (an OpenAI SDK request with a tenant's new key) until the shim takes the
    key, which it learns with control's next snapshot; whether it did within `timeout`. A
    401 is refused before routing, so the call that gets through is the first one routed."""
    import openai

    def through() -> bool:
        try:
            call()
        except openai.AuthenticationError:
            return False
        return True

    return wait_until(through, timeout)

