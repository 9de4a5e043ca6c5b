"""The Grafana dashboard (docs/grafana/baton.json) against a real Prometheus: Debian's
`prometheus` (scripts/engines/setup.sh installs it) scrapes a sim fleet that served chat
requests, a streamed one, a retry, a mid-stream failover, an unknown model and a speculative
pair, and every panel's PromQL must return data.

The fleet (round robin, in config order): s0 is the pair's target (draft d), s1 answers 503
(a retry before the first byte; it is demoted), s2 dies after 5 tokens (a stream longer than
that fails over to s0). Probes every 60 s: the demoted stay demoted."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from scripts.engines.replicas import free_port
from tests.integration.harness import (
    MODEL,
    Fleet,
    fleet,
    http,
    once_key_taken,
    start_sim,
    wait_until,
)

pytestmark = [pytest.mark.real, pytest.mark.timeout(180)]

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "baton.json"
# What Grafana puts in for its own variables; scrapes are 1 s apart, so 1m holds 60.
GRAFANA_VARS = {
    "${__rate_interval}": "1m",
    "$__rate_interval": "1m",
    "${__interval}": "15s",
    "$__interval": "15s",
    "${__range}": "5m",
    "$__range": "5m",
}
PER_SIM = [(), ("--fault", "status=503"), ("--fault", "die-after=5")]
AGREE = ("--draft-agree-rate", "0.4")


def panels(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows (collapsed rows keep theirs) included."""
    for p in node.get("panels", []):
        yield p
        yield from panels(p)


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr with Grafana's variables put in) for every target."""
    out = []
    for p in panels(dashboard):
        for t in p.get("targets", []):
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((p["title"], t["refId"], expr))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_dashboard_is_importable_with_a_datasource_variable(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), ids
    want = {"type": "prometheus", "uid": "${datasource}"}
    for p in panels(dashboard):
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys(), p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == want and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == want and t["expr"], (p["title"], t)
    for title, ref, expr in queries(dashboard):
        assert "$" not in expr, f"{title} {ref}: a Grafana variable the test does not know"


class Prometheus:
    def __init__(self, binary: str, tmp: Path, jobs: dict[str, str]) -> None:
        """`jobs`: job name -> host:port serving /metrics. Its own port, config and data dir."""
        scrape = [
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']"
            for job, target in jobs.items()
        ]
        tmp.mkdir(parents=True, exist_ok=True)
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n" + "\n".join(scrape) + "\n"
        )
        self.jobs = jobs
        self.log = tmp / "prometheus.log"
        for _ in range(3):  # the port is picked free, then bound: another may take it between
            self.url = f"http://127.0.0.1:{free_port()}"
            with self.log.open("wb") as log:
                self.proc = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                     f"--web.listen-address={self.url.removeprefix('http://')}",
                     "--log.level=warn"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )  # fmt: skip
            if wait_until(self._ready, timeout=30, interval=0.1) and self.proc.poll() is None:
                return
            self.stop()
        raise AssertionError(f"prometheus did not start: {self.log.read_text()[-2000:]}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            return True  # exited: no use waiting
        try:
            return http("GET", self.url + "/-/ready")[0] == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        status, body = http("GET", self.url + "/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}))  # fmt: skip
        answer = json.loads(body)
        assert status == 200 and answer["status"] == "success", (expr, answer)
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def scraped(self) -> bool:
        """Every job scraped and up."""
        up = {r["metric"]["job"]: r["value"][1] for r in self.query("up")}
        return up == {job: "1" for job in self.jobs}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    """Missing is a failure, as a missing engine is in this suite (the conftest's pool)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run `make engines` (scripts/engines/setup.sh "
                    "installs Debian's `prometheus` package)")  # fmt: skip
    return binary


@contextmanager
def prometheus(binary: str, tmp: Path, jobs: dict[str, str]) -> Iterator[Prometheus]:
    prom = Prometheus(binary, tmp, jobs)
    try:
        yield prom
    finally:
        prom.stop()


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def serve_traffic(f: Fleet) -> None:
    c = openai.OpenAI(base_url=f.base_url, api_key="x", max_retries=0, timeout=30)

    def chat(i: int, n: int, stream: bool) -> str:
        kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                                  max_tokens=n, temperature=0)  # fmt: skip
        if not stream:
            return c.chat.completions.create(**kw).choices[0].message.content or ""
        chunks = c.chat.completions.create(**kw, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    # Short enough that s2 (dies after 5 tokens) serves them whole: s0 by the pair, s1's 503
    # retried on a fallback.
    for i in range(6):
        assert chat(i, 4, stream=i % 3 == 2)
    # Longer streams until one lands on s2 and fails over (round robin: the first or second).
    for i in range(4):
        assert chat(100 + i, 20, stream=True)
        if b"baton_shim_failovers_total{" in http("GET", f.shim.ready + "/metrics")[1]:
            break
    else:
        raise AssertionError("no failover in 4 streams")
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # Last (from here on the shim asks every client for a key): a tenant at its limit, for the
    # Tenants row. Its one request a minute is served; the next is refused for it. Its budget
    # gives the spend panel its series (the model has no price: 0 spent, all of it left).
    out = f.baton("tenants", "add", "acme", "--rpm", "1", "--budget", "100/day", "--json")
    assert out.returncode == 0, out.stderr
    key = json.loads(out.stdout)["key"]
    t = openai.OpenAI(base_url=f.base_url, api_key=key, max_retries=0, timeout=30)

    assert once_key_taken(lambda: t.completions.create(model=MODEL, prompt="tenant",
                                                        max_tokens=4))  # fmt: skip
    with pytest.raises(openai.RateLimitError):
        t.completions.create(model=MODEL, prompt="again", max_tokens=4)


def test_every_panel_query_returns_data(
    tmp_path: Path, dashboard: dict[str, Any], prometheus_bin: str
) -> None:
    with fleet(tmp_path, n=3, per_sim=PER_SIM, probe_interval=60,
               control_extra='routing = "roundrobin"') as f:  # fmt: skip
        draft = start_sim(*AGREE)
        f.parts.append(draft)  # stopped with the fleet
        out = f.baton("backends", "add", "d", "--url", draft.ready, "--model", MODEL,
                      "--role", "draft")  # fmt: skip
        assert out.returncode == 0, out.stderr
        out = f.baton("pairs", "bind", "d", "s0", "-k", "4")
        assert out.returncode == 0, out.stderr
        jobs = {
            "baton-shim": f.shim.ready.removeprefix("http://"),
            "baton-control": f.control.announced["METRICS"]
            .removeprefix("http://")
            .removesuffix("/metrics"),
        }
        with prometheus(prometheus_bin, tmp_path / "prometheus", jobs) as prom:
            # Scraped before the traffic: counters and histograms have a sample to rise from.
            assert wait_until(prom.scraped, timeout=30, interval=0.2), prom.query("up")
            serve_traffic(f)
            started = time.monotonic()
            wanted = queries(dashboard)
            missing = list(wanted)

            def answered() -> bool:
                missing[:] = [q for q in missing if not has_data(prom.query(q[2]))]
                return not missing

            wait_until(answered, timeout=60, interval=0.5)
            assert not missing, "panel queries without data:\n" + "\n".join(
                f"  {title} [{ref}]: {expr} -> {prom.query(expr)}" for title, ref, expr in missing
            )
            print(f"{len(wanted)} queries answered {time.monotonic() - started:.1f} s after "
                  "the traffic")  # fmt: skip
