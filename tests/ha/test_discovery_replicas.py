"""Discovery with control replicas (issue 45, docs/discovery.md "With control replicas"):
every replica watches the Kubernetes API, only the leader changes the fleet, and a new leader
acts at once on what its own watch already holds. Real processes: etcd 3.5, three control
replicas each with a [[discovery.kubernetes]] source on a mock apiserver
(tests/integration/kube_api.py, on kmock), sims as the engines, a shim."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from clients.client import AdminClient
from clients.procs import Part
from control.replicas.etcd import Etcd
from tests.ha.group import Group, group
from tests.integration.harness import (
    MODEL,
    Streamed,
    http,
    metric,
    start_sims,
    stream,
    wait_until,
)
from tests.integration.kube_api import Cluster, endpoint_slice

pytestmark = [pytest.mark.ha, pytest.mark.timeout(180)]

SOURCE = "k8s:llm/vllm"
V0, V1 = "llm/vllm-0", "llm/vllm-1"
# 500 tokens at 20 ms a step: a 10 s stream, still running through a takeover.
SLOW, TOKENS, STORY = ("--decode-ms-per-step", "20"), 500, "a story told through a takeover"

Change = tuple[str, str, str]  # (the replica that wrote it, action, backend)


@dataclass
class Watched:
    g: Group
    cluster: Cluster
    sims: list[Part]

    def endpoint(self, i: int, *, ready: bool = True, terminating: bool = False) -> None:
        """Endpoint vllm-i (pod vllm-i) of Service vllm, on sim i."""
        port = urlsplit(self.sims[i].ready).port or 0
        self.cluster.put("slices", endpoint_slice(f"vllm-{i}", "vllm", "127.0.0.1", port,
                                                  f"vllm-{i}", ready=ready,
                                                  terminating=terminating))  # fmt: skip

    def ids(self) -> set[str]:
        """The fleet's backends, from the leader (any replica's address leads there)."""
        with AdminClient(self.g.control, timeout=5.0) as admin:
            return {b.id for b in admin.list_backends()}

    def rows(self, control: str = "") -> dict[str, dict[str, Any]]:
        """`baton backends list --json` through `control` (else every replica's address)."""
        out = self.g.baton("backends", "list", "--json", control=control)
        assert out.returncode == 0, out.stderr
        return {r["id"]: r for r in json.loads(out.stdout)}

    def registered(self, rid: str) -> float:
        """Backends in replica `rid`'s own registry, in any state (its /metrics)."""
        return self.g.metric(rid, "baton_backends")

    def shown(self) -> Counter[tuple[str, str]]:
        """Discovery's changes to the fleet in `baton events --kind admin`: (action, backend)."""
        out = self.g.baton("events", "--kind", "admin", "--json")
        assert out.returncode == 0, out.stderr
        return Counter((e["action"], e["backend_id"]) for e in json.loads(out.stdout)
                       if e.get("source") == SOURCE)  # fmt: skip

    def written(self) -> Counter[Change]:
        """Discovery's events as etcd holds them, each with the replica that wrote it (its
        key is PREFIX/events/TIME/REPLICA/SEQ)."""

        async def read() -> Counter[Change]:
            client = Etcd(self.g.etcd.store_url.removeprefix("etcd://").split(","))
            try:
                kvs, _ = await client.get_prefix(b"/baton/events/")
            finally:
                await client.close()
            out: Counter[Change] = Counter()
            for kv in kvs:
                e = json.loads(kv.value)
                if e.get("kind") == "admin" and e.get("source") == SOURCE:
                    out[(kv.key.decode().split("/")[-2], e["action"], e["backend_id"])] += 1
            return out

        return asyncio.run(read())


@contextmanager
def watched(tmp_path: Path) -> Iterator[Watched]:
    """Two sims, and three replicas (no backends configured) each watching the mock
    apiserver for Service vllm's EndpointSlices, and a shim."""
    with Cluster() as cluster:
        sims = start_sims([SLOW, SLOW])
        try:
            source = ('[[discovery.kubernetes]]\nnamespace = "llm"\nservice = "vllm"\n'
                      f'port = "http"\napi = "{cluster.url}"\n')  # fmt: skip
            with group(tmp_path, sims=0, shims=1, extra=source) as g:
                yield Watched(g, cluster, sims)
        finally:
            for s in sims:
                s.stop(grace=3)


def chat(shim: Part, text: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    status, _ = http("POST", shim.ready + "/v1/chat/completions", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})  # fmt: skip
    return status


def running(sim: Part) -> float:
    return metric(sim.ready, "vllm:num_requests_running")


def in_background(call: Callable[[], Streamed]) -> tuple[threading.Thread, list[Streamed]]:
    """`call` on a thread of its own; what it returned is in the list once it is joined."""
    got: list[Streamed] = []
    t = threading.Thread(target=lambda: got.append(call()), daemon=True)
    t.start()
    return t, got


def joins_once_by_the_leader(w: Watched, leader: str) -> None:
    """A ready endpoint: the leader adds it, once; every replica shows it; the followers'
    own registries stay empty (they watch, and leave the fleet to the leader)."""
    g = w.g
    # Every replica watches the apiserver: one open watch each.
    assert wait_until(lambda: w.cluster.watching == len(g.replicas), 20)
    w.endpoint(0)  # no model annotation: the leader asks the engine's /v1/models
    assert wait_until(lambda: w.ids() == {V0}, 20)
    for rid, part in g.replicas.items():  # through each replica: the leader's fleet
        row = w.rows(part.ready)[V0]
        assert (row["source"], row["url"], row["model"], row["state"]) == (
            SOURCE, w.sims[0].ready, MODEL, "healthy"), rid  # fmt: skip
        assert w.registered(rid) == (1 if rid == leader else 0), rid
    assert wait_until(lambda: w.written() == Counter({(leader, "add", V0): 1}), 10)
    assert w.shown() == Counter({("add", V0): 1})
    assert g.followed(leader)
    before = metric(w.sims[0].ready, "vllm:prompt_tokens_total")
    assert chat(g.shims[0], "hello") == 200
    assert metric(w.sims[0].ready, "vllm:prompt_tokens_total") > before


def test_every_replica_watches_only_the_leader_acts_and_a_new_leader_acts_on_its_view(
    tmp_path: Path,
) -> None:
    with watched(tmp_path) as w:
        g = w.g
        # What the story is, unmoved (sim 1 is no backend yet).
        ref, want = in_background(lambda: stream(w.sims[1].ready, TOKENS, STORY))
        old = g.wait_leader()
        joins_once_by_the_leader(w, old)
        reader, got = in_background(lambda: stream(g.shims[0].ready, TOKENS, STORY))
        assert wait_until(lambda: running(w.sims[0]) == 1, 20)
        lists = w.cluster.lists
        g.stop(old)  # SIGKILL; then, while no replica leads, a rollout step:
        w.endpoint(1)  # a new engine is ready
        w.endpoint(0, ready=False, terminating=True)  # the old one's pod is being deleted
        new = g.wait_leader(not_=old)
        # The new leader drains vllm-0 with migrate: the stream leaves it while it is listed.
        assert wait_until(lambda: running(w.sims[0]) == 0, 20)
        rows = w.rows()
        assert set(rows) == {V0, V1}
        assert (rows[V0]["state"], rows[V0]["migrating"], rows[V0]["reason"]) == (
            "draining", True, f"terminating ({SOURCE})")  # fmt: skip
        assert (rows[V1]["state"], rows[V1]["source"]) == ("healthy", SOURCE)
        # From its own watch: no replica listed again, and the dead one's watch is gone.
        assert w.cluster.lists == lists and w.cluster.watching == len(g.replicas) - 1
        reader.join(60)
        ref.join(60)
        assert got and got[0].ok and want and got[0].text == want[0].text
        moved = json.loads(g.baton("events", "--kind", "failover", "--json").stdout)
        assert [(e["from_backend"], e["failure"]) for e in moved] == [(V0, "migrate")]
        w.cluster.delete("slices", "vllm-0")  # the pod is gone
        assert wait_until(lambda: w.ids() == {V1}, 20)
        assert g.followed(new) and chat(g.shims[0], "after") == 200
        # Each change written once, by the replica leading then; the other never wrote. The
        # new leader's registry held none of vllm-0 (a follower's holds no discovered
        # backend): it adds it to its own fleet once, as its predecessor had it, and drains it.
        after = {(new, "add", V0): 1, (new, "drain", V0): 1, (new, "add", V1): 1,
                 (new, "remove", V0): 1}  # fmt: skip
        assert wait_until(lambda: w.written() == Counter({(old, "add", V0): 1, **after}), 10)
        shown = Counter({("add", V0): 2, ("drain", V0): 1, ("add", V1): 1, ("remove", V0): 1})
        assert wait_until(lambda: w.shown() == shown, 10)
        (other,) = set(g.replicas) - {old, new}
        assert w.registered(other) == 0 and w.registered(new) == 1
