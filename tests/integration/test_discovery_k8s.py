"""Discovery from the Kubernetes API through real processes: sims, control (watching a mock
apiserver, tests/integration/kube_api.py on kmock) and a shim. Engines join when their
endpoint is ready, get no new requests while it is not, move their live streams when it is
terminating (before the mock removes it, 5 s later, whatever Baton does), and leave when it is
gone; a 410 on the watch and a dropped watch connection leave control's view right; and the
endpoints scaled 2 -> 10 -> 2 under 50 concurrent streams drop no request.

The API is a mock, not a real apiserver: none can be had from the registries here."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from clients.client import AdminClient, BackendRow
from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    Streamed,
    cli_json,
    http,
    metric,
    start_control,
    start_shim,
    start_sim,
    stream,
    wait_until,
    write_config,
)
from tests.integration.kube_api import Cluster, endpoint_slice, pod

pytestmark = pytest.mark.timeout(180)

SOURCE = "k8s:llm/vllm"
GRACE_S = 5.0  # the mock's terminationGracePeriod: it removes the endpoint then, come what may
# 25 ms a token: a 200-token stream runs 5 s, long enough to be caught mid-flight.
SLOW = ("--decode-ms-per-step", "25")


def port(p: Part) -> int:
    return urlsplit(p.ready).port or 0


@dataclass
class Discovered:
    cluster: Cluster
    sims: list[Part]
    control: Part
    shim: Part

    def backends(self) -> dict[str, BackendRow]:
        with AdminClient(self.control.ready, timeout=10.0) as admin:
            return {b.id: b for b in admin.list_backends()}

    def ready(self, i: int, *, ready: bool = True, terminating: bool = False,
              sim: int | None = None) -> None:  # fmt: skip
        """Endpoint vllm-i (pod vllm-i) of Service vllm, on sim `sim` (default i)."""
        s = self.sims[i if sim is None else sim]
        self.cluster.put("slices", endpoint_slice(f"vllm-{i}", "vllm", "127.0.0.1", port(s),
                                                  f"vllm-{i}", ready=ready,
                                                  terminating=terminating))  # fmt: skip

    def ids(self) -> set[str]:
        return set(self.backends())


@contextmanager
def discovered(
    tmp_path: Path, sims: int, *sim_args: str, selector: str = ""
) -> Iterator[Discovered]:
    parts: list[Part] = []
    with Cluster() as cluster:
        try:
            for _ in range(sims):
                parts.append(start_sim(*sim_args))
            how = f'selector = "{selector}"' if selector else 'service = "vllm"'
            source = ("[[discovery.kubernetes]]\nnamespace = \"llm\"\n"
                      f"{how}\nport = \"http\"\napi = \"{cluster.url}\"\n")  # fmt: skip
            config = write_config(tmp_path / "control.toml", [], extra=source, probe_interval=0.2)
            control = start_control(config)
            parts.append(control)
            shim = start_shim(control.ready)
            parts.append(shim)
            yield Discovered(cluster, parts[:sims], control, shim)
        finally:
            for p in reversed(parts):
                p.stop(grace=3)


def complete(base: str, prompt: str = "hello") -> int:
    status, _ = http("POST", base + "/v1/completions",
                     json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode(),
                     {"Content-Type": "application/json"})  # fmt: skip
    return status


def served(sim: Part) -> float:
    return metric(sim.ready, "vllm:prompt_tokens_total")


def test_a_ready_endpoint_joins_beside_an_operators_backend_and_leaves_when_gone(
    tmp_path: Path,
) -> None:
    with discovered(tmp_path, 2) as d:
        d.ready(0)  # no model annotation: control asks the engine's /v1/models
        assert wait_until(lambda: "llm/vllm-0" in d.ids(), 20)
        row = d.backends()["llm/vllm-0"]
        assert (row.model, row.source, row.url) == (MODEL, SOURCE, d.sims[0].ready)
        assert complete(d.shim.ready) == 200 and served(d.sims[0]) > 0
        cli_json(d.control, "backends", "add", "mine", "--url", d.sims[1].ready, "--model", MODEL)
        listed = {r["id"]: r["source"] for r in cli_json(d.control, "backends", "list")}
        assert listed == {"llm/vllm-0": SOURCE, "mine": "cli"}
        d.cluster.delete("slices", "vllm-0")
        assert wait_until(lambda: d.ids() == {"mine"}, 20)  # an operator's backend stays
        assert complete(d.shim.ready) == 200


def test_a_not_ready_endpoint_gets_no_new_requests_until_ready_again(tmp_path: Path) -> None:
    with discovered(tmp_path, 2) as d:
        d.ready(0)
        d.ready(1)
        assert wait_until(lambda: d.ids() == {"llm/vllm-0", "llm/vllm-1"}, 20)
        d.ready(0, ready=False)
        assert wait_until(lambda: d.backends()["llm/vllm-0"].state == "draining", 20)
        assert d.backends()["llm/vllm-0"].reason == f"not ready ({SOURCE})"
        before = served(d.sims[0])
        assert all(complete(d.shim.ready, f"q{i}") == 200 for i in range(6))
        assert served(d.sims[0]) == before
        d.ready(0)
        assert wait_until(lambda: d.backends()["llm/vllm-0"].state == "healthy", 20)


def reference(prompt: str, tokens: int) -> str:
    ref = start_sim()
    try:
        return stream(ref.ready, tokens, prompt).text
    finally:
        ref.stop()


def test_a_terminating_endpoint_moves_its_live_stream_before_it_is_removed(
    tmp_path: Path,
) -> None:
    want = reference("a story to move", 200)
    with discovered(tmp_path, 2, *SLOW) as d:
        d.ready(0)
        d.ready(1)
        assert wait_until(lambda: d.ids() == {"llm/vllm-0", "llm/vllm-1"}, 20)
        got: list[Streamed] = []
        reader = threading.Thread(target=lambda: got.append(stream(d.shim.ready, 200,
                                                                   "a story to move")))  # fmt: skip
        reader.start()
        running = [lambda i=i: metric(d.sims[i].ready, "vllm:num_requests_running")
                   for i in range(2)]  # fmt: skip
        assert wait_until(lambda: any(r() == 1 for r in running), 20)
        i = 0 if running[0]() == 1 else 1
        removed = threading.Event()

        def grace() -> None:  # the kubelet's grace period: the endpoint goes, whatever Baton did
            if not removed.wait(GRACE_S):
                d.cluster.delete("slices", f"vllm-{i}")
                removed.set()

        d.ready(i, ready=False, terminating=True)
        timer = threading.Thread(target=grace, daemon=True)
        timer.start()
        # The stream leaves the terminating engine while its endpoint is still listed.
        assert wait_until(lambda: running[i]() == 0 or removed.is_set(), 20)
        assert not removed.is_set(), "the stream was still on the engine when it was removed"
        row = d.backends()[f"llm/vllm-{i}"]
        assert row.migrating and row.reason == f"terminating ({SOURCE})"
        reader.join(60)
        assert got and got[0].ok and got[0].text == want  # byte-identical to an unmoved one
        timer.join(GRACE_S + 5)
        assert wait_until(lambda: f"llm/vllm-{i}" not in d.ids(), 20)
        moved = cli_json(d.control, "events", "--kind", "failover")
        assert [(e["from_backend"], e["failure"]) for e in moved] == [(f"llm/vllm-{i}", "migrate")]


def test_a_410_on_the_watch_lists_again(tmp_path: Path) -> None:
    with discovered(tmp_path, 2) as d:
        d.ready(0)
        assert wait_until(lambda: d.ids() == {"llm/vllm-0"} and d.cluster.watching > 0, 20)
        lists = d.cluster.lists
        # Changes whose events the watch never gets (compacted away), then the 410.
        d.cluster.delete("slices", "vllm-0", quietly=True)
        d.cluster.put("slices", endpoint_slice("vllm-1", "vllm", "127.0.0.1", port(d.sims[1]),
                                               "vllm-1"), quietly=True)  # fmt: skip
        d.cluster.expire()
        assert wait_until(lambda: d.ids() == {"llm/vllm-1"}, 20)
        assert d.cluster.lists > lists


def test_a_dropped_watch_resumes_from_its_resource_version(tmp_path: Path) -> None:
    with discovered(tmp_path, 2) as d:
        d.ready(0)
        assert wait_until(lambda: d.ids() == {"llm/vllm-0"} and d.cluster.watching > 0, 20)
        lists, watches = d.cluster.lists, d.cluster.watches
        d.cluster.drop(hold=True)  # the connection is cut; the apiserver is away a while
        d.cluster.delete("slices", "vllm-0")
        d.ready(1)
        assert d.ids() == {"llm/vllm-0"}  # nothing heard yet
        d.cluster.release()
        assert wait_until(lambda: d.ids() == {"llm/vllm-1"}, 20)
        # Watched again from where it was (the events it missed replayed), not re-listed.
        assert d.cluster.lists == lists and d.cluster.watches > watches


def test_pods_by_selector_join_with_their_annotations_and_drain_when_deleted(
    tmp_path: Path,
) -> None:
    notes = {"baton.dev/model": MODEL, "baton.dev/kind": "vllm"}
    with discovered(tmp_path, 2, selector="app=vllm") as d:
        for i, app in enumerate(("vllm", "other")):
            d.cluster.put("pods", pod(f"p{i}", {"app": app}, "127.0.0.1", port(d.sims[i]),
                                      annotations=notes))  # fmt: skip
        assert wait_until(lambda: d.ids() == {"llm/p0"}, 20)
        assert d.backends()["llm/p0"].source == "k8s:llm/app=vllm"
        d.cluster.put("pods", pod("p0", {"app": "vllm"}, "127.0.0.1", port(d.sims[0]),
                                  deleting=True, annotations=notes))  # fmt: skip
        assert wait_until(lambda: d.backends()["llm/p0"].migrating, 20)
        d.cluster.delete("pods", "p0")
        assert wait_until(lambda: d.ids() == set(), 20)


PROMPTS = [f"scaling story {i}" for i in range(5)]
STREAMS, TOKENS = 50, 40


def test_scaling_2_to_10_to_2_under_50_streams_drops_no_request(tmp_path: Path) -> None:
    """Ten endpoints over four engines (an engine may stand behind several endpoints, as one
    node's engines behind its pods); scaling down terminates every endpoint of engines 2 and
    3, which are idle by the time their endpoints are removed."""
    ref = start_sim()
    try:
        want = {p: stream(ref.ready, TOKENS, p).text for p in PROMPTS}
    finally:
        ref.stop()
    with discovered(tmp_path, 4, "--decode-ms-per-step", "15") as d:
        for i in range(2):
            d.ready(i)
        assert wait_until(lambda: len(d.ids()) == 2, 20)
        done: list[tuple[str, Streamed]] = []
        stop = threading.Event()

        def load(k: int) -> None:
            while not stop.is_set():
                p = PROMPTS[k % len(PROMPTS)]
                done.append((p, stream(d.shim.ready, TOKENS, p)))

        workers = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(STREAMS)]
        for w in workers:
            w.start()
        assert wait_until(lambda: len(done) >= STREAMS, 60)
        for i in range(2, 10):
            d.ready(i, sim=i % 4)
        assert wait_until(lambda: len(d.ids()) == 10, 30)
        # Every new engine takes requests before the fleet shrinks again.
        assert wait_until(lambda: all(served(s) > 0 for s in d.sims), 30)
        for i in range(2, 10):
            d.ready(i, sim=i % 4, ready=False, terminating=True)
        assert wait_until(lambda: all(d.backends()[f"llm/vllm-{i}"].migrating
                                      for i in range(2, 10)), 20)  # fmt: skip
        idle = [lambda s=s: metric(s.ready, "vllm:num_requests_running") == 0 for s in d.sims[2:]]
        assert wait_until(lambda: all(f() for f in idle), GRACE_S)  # before the grace is up
        for i in range(2, 10):
            d.cluster.delete("slices", f"vllm-{i}")
        assert wait_until(lambda: len(d.ids()) == 2, 20)
        for s in d.sims[2:]:
            s.stop(grace=3)  # the engines' SIGTERM: nothing of theirs is left to cut
        n = len(done)
        assert wait_until(lambda: len(done) >= n + STREAMS, 60)
        stop.set()
        for w in workers:
            w.join(30)
        # Streams did move off the terminating endpoints, and nothing failed over otherwise.
        moved = cli_json(d.control, "events", "--kind", "failover")
        assert moved and {e["failure"] for e in moved} == {"migrate"}
    bad = [(p, s) for p, s in done if not s.ok or s.text != want[p]]
    assert not bad, bad[:3]
