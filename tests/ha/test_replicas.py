"""Control replicas on a real etcd (docs/replicas.md): leadership and fencing, the store
through a leader's death and etcd's, admin writes from two CLIs, soft state through a
takeover. Real processes: etcd 3.5, `baton control --store etcd://...`, sims, shims."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from baton.replicas import LEADER_METADATA
from baton.v1 import admin_pb2, admin_pb2_grpc, fleet_pb2
from control.exceptions import StoreConflict
from control.fleet.db import Configured
from control.replicas import etcd as etcd_ops
from control.replicas.etcd import Etcd
from control.replicas.store import ReplicaStore
from tests.ha.group import Group, group
from tests.integration.harness import (
    MODEL,
    http_full,
    start_control_replica,
    start_etcd,
    start_shim,
    wait_until,
)

pytestmark = [pytest.mark.ha, pytest.mark.timeout(240)]


def add_backend(g: Group, rid: str, bid: str) -> grpc.StatusCode:
    """AddBackend straight to one replica (no CLI, no following): OK or its refusal."""
    backend = fleet_pb2.Backend(id=bid, url=f"http://127.0.0.1:9/{bid}", model="other")
    with grpc.insecure_channel(g.replicas[rid].ready) as ch:
        try:
            admin_pb2_grpc.AdminServiceStub(ch).AddBackend(
                admin_pb2.AddBackendRequest(backend=backend), timeout=5
            )
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]


def routed(g: Group, rid: str) -> float:
    """Routes the replica decided for a model served (Group.route's probes are for none)."""
    total = g.metric(rid, "baton_routes_total")
    return total - g.metric(rid, "baton_routes_total", 'reason="unknown-model"')


def pins_held(g: Group, rid: str) -> float:
    return g.metric(rid, "baton_pins", 'kind="prefix"')


def pin_hits(g: Group, rid: str) -> float:
    return g.metric(rid, "baton_routes_total", 'reason="pin-hit"')


def backend_ids(g: Group) -> set[str]:
    out = g.baton("backends", "list", "--json")
    assert out.returncode == 0, out.stderr
    return {row["id"] for row in json.loads(out.stdout)}


def test_followers_refuse_naming_the_leader_and_status_shows_the_group(tmp_path: Path) -> None:
    with group(tmp_path) as g:
        leader = g.wait_leader()
        follower = next(r for r in g.replicas if r != leader)
        with grpc.insecure_channel(g.replicas[follower].ready) as ch:
            with pytest.raises(grpc.RpcError) as refused:
                admin_pb2_grpc.AdminServiceStub(ch).ListBackends(
                    admin_pb2.ListBackendsRequest(), timeout=5
                )
        err = refused.value
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"the leader is {leader} at {g.replicas[leader].ready}" in err.details()
        assert (LEADER_METADATA, g.replicas[leader].ready) in tuple(err.trailing_metadata())
        assert g.route(follower) == grpc.StatusCode.FAILED_PRECONDITION
        status = g.status(follower)
        assert status is not None and status.leader == leader
        assert {r.id for r in status.replicas} == set(g.replicas)
        assert [r.id for r in status.replicas if r.leader] == [leader]
        assert status.store == f"{g.etcd.store_url}: ok"
        assert g.metric(leader, "baton_replica_leading") == 1.0
        assert g.metric(follower, "baton_replica_leading") == 0.0
        assert g.metric(follower, "baton_replica_store_up") == 1.0
        followers = len(g.replicas) - 1
        assert wait_until(lambda: g.metric(leader, "baton_replica_followers") == followers)
        shown = g.baton("status")  # through the follower first: the CLI goes to the leader
        assert shown.returncode == 0, shown.stderr
        assert leader in shown.stdout and "follower" in shown.stdout


def test_a_stopped_leader_resumed_after_its_lease_refuses_routes_and_writes(
    tmp_path: Path,
) -> None:
    with group(tmp_path) as g:
        old = g.wait_leader()
        seen: list[list[str]] = []
        g.stop(old, signal.SIGSTOP)
        try:
            new = g.wait_leader(not_=old)  # its lease ran out; another took the key
            assert add_backend(g, new, "while-stopped") == grpc.StatusCode.OK
        finally:
            g.stop(old, signal.SIGCONT)
        # At once after it wakes: nothing it decides or writes counts.
        assert g.route(old, "after-wake") == grpc.StatusCode.FAILED_PRECONDITION
        assert add_backend(g, old, "from-the-old-leader") == grpc.StatusCode.FAILED_PRECONDITION
        for _ in range(20):
            seen.append(g.claims())
        assert all(claims == [new] for claims in seen), seen  # one leader, ever
        assert g.routes(new)
        ids = backend_ids(g)
        assert "while-stopped" in ids and "from-the-old-leader" not in ids


def test_the_leader_killed_another_routes_within_seconds_and_the_config_is_intact(
    tmp_path: Path,
) -> None:
    with group(tmp_path, shims=1) as g:
        old = g.wait_leader()
        for bid in ("added-1", "added-2"):
            assert add_backend(g, old, bid) == grpc.StatusCode.OK
        out = g.baton("backends", "drain", "s1")
        assert out.returncode == 0, out.stderr
        out = g.baton("tenants", "add", "acme", "--rpm", "100", "--json")
        assert out.returncode == 0, out.stderr
        key = json.loads(out.stdout)["key"]
        before = g.baton("backends", "list", "--json").stdout
        g.stop(old)
        killed = time.monotonic()
        new = g.wait_leader(not_=old)
        took = time.monotonic() - killed
        assert took < 5.0, f"a new leader routed {took:.2f}s after the kill"
        rows = {r["id"]: r for r in json.loads(g.baton("backends", "list", "--json").stdout)}
        assert {r["id"] for r in json.loads(before)} == set(rows)
        assert rows["s1"]["state"] == "draining"
        tenants = json.loads(g.baton("tenants", "list", "--json").stdout)
        assert [t["id"] for t in tenants] == ["acme"]
        # The shim follows: a request through it is served, routed by the new leader.
        assert g.followed(new)
        status, _, _ = http_full(
            "POST", g.shims[0].ready + "/v1/completions",
            json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )  # fmt: skip
        assert status == 200
        assert routed(g, new) >= 1
        assert g.claims() == [new]


def test_etcd_killed_control_routes_from_memory_and_admin_names_etcd(tmp_path: Path) -> None:
    with group(tmp_path) as g:
        leader = g.wait_leader()
        assert add_backend(g, leader, "before") == grpc.StatusCode.OK
        g.etcd.kill()
        # Well past the lease (1 s): the leader goes on deciding routes from memory.
        deadline = time.monotonic() + 3.0
        n = 0
        while time.monotonic() < deadline:
            assert g.route(leader, f"r{n}") == grpc.StatusCode.OK
            n += 1
        out = g.baton("backends", "add", "during", "--url", "http://127.0.0.1:9/", "--model", "x")
        assert out.returncode != 0
        assert "etcd" in out.stderr, out.stderr
        g.etcd.restart()
        # Once etcd answers: the same leader, writes taken, and everything from before there.
        assert wait_until(lambda: add_backend(g, leader, "after") == grpc.StatusCode.OK, 15)
        assert g.claims() == [leader]
        ids = backend_ids(g)
        assert {"before", "after"} <= ids and "during" not in ids


def test_two_clis_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    with group(tmp_path) as g:
        failures: list[str] = []

        def writer(prefix: str) -> None:
            for i in range(6):
                out = g.baton("backends", "add", f"{prefix}{i}", "--url",
                              f"http://127.0.0.1:9/{prefix}{i}", "--model", "other")  # fmt: skip
                if out.returncode != 0:
                    failures.append(out.stderr)

        threads = [threading.Thread(target=writer, args=(p,)) for p in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert failures == []
        want = {f"{p}{i}" for p in "ab" for i in range(6)}
        assert want <= backend_ids(g)
        # And in etcd, as the next leader reads it.
        old = g.wait_leader()
        g.stop(old)
        g.wait_leader(not_=old)
        assert want <= backend_ids(g)


def test_a_stale_writer_is_refused_by_etcd_not_silently_overwritten(tmp_path: Path) -> None:
    async def scenario(url: str) -> None:
        client = Etcd(url.removeprefix("etcd://").split(","))
        first, second = ReplicaStore(client, "/t"), ReplicaStore(client, "/t")
        ok, resp = await client.txn(
            [etcd_ops.compare_create(first.leader_key, 0)], [etcd_ops.put(first.leader_key, b"x")]
        )
        assert ok
        term = resp.header.revision
        await first.load()
        await second.load()  # both read the same revision
        await first.save(Configured(removed=frozenset({"a"})), term)
        with pytest.raises(StoreConflict):
            await second.save(Configured(removed=frozenset({"b"})), term)
        await second.load()
        assert (await second.load())[0].removed == frozenset({"a"})
        await client.close()

    server = start_etcd(tmp_path)
    try:
        asyncio.run(scenario(server.store_url))
    finally:
        server.stop()


def test_pins_and_tenants_windows_survive_a_takeover(tmp_path: Path) -> None:
    with group(tmp_path, shims=1, sims=3) as g:
        shim = g.shims[0].ready
        out = g.baton("tenants", "add", "acme", "--rpm", "30", "--json")
        assert out.returncode == 0, out.stderr
        key = json.loads(out.stdout)["key"]
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}

        def chat(messages: list[dict[str, str]]) -> tuple[int, str]:
            body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}
            status, raw, _ = http_full(
                "POST", shim + "/v1/chat/completions", json.dumps(body).encode(), headers
            )
            if status != 200:
                return status, raw.decode()
            return status, json.loads(raw)["choices"][0]["message"]["content"]

        assert wait_until(lambda: chat([{"role": "user", "content": "x"}])[0] != 401)
        convs: list[list[dict[str, str]]] = []
        for i in range(8):  # first turns: spread over the sims, each one pinned where it went
            msgs = [{"role": "user", "content": f"conversation {i}"}]
            status, text = chat(msgs)
            assert status == 200, text
            convs.append([*msgs, {"role": "assistant", "content": text}])
        old = g.wait_leader()
        hits = pin_hits(g, old)
        for msgs in convs:  # second turns: pinned
            msgs.append({"role": "user", "content": "and then?"})
            assert chat(msgs)[0] == 200
        assert pin_hits(g, old) - hits == len(convs)
        # The leader streams its changes every 50 ms: the followers have them (a kill in
        # the middle of a stream of changes loses at most the last batch; bench/ha.py
        # measures the pin-hit rate through one).
        assert wait_until(lambda: len({pins_held(g, rid) for rid in g.replicas}) == 1)
        # 1 + 8 + 8 requests in the window; the new leader must count them.
        g.stop(old)
        new = g.wait_leader(not_=old)
        assert g.followed(new)
        for msgs in convs:  # third turns, through the new leader: the pins held
            msgs.append({"role": "user", "content": "more"})
            assert chat(msgs)[0] == 200
        assert pin_hits(g, new) == len(convs)
        statuses = [chat([{"role": "user", "content": f"fill {i}"}])[0] for i in range(8)]
        # 25 counted before these 8: 5 more fit under 30, not 8 (a fresh window would take
        # all of them).
        assert statuses.count(200) == 5, statuses
        assert statuses.count(429) == 3, statuses


def test_stored_responses_owners_outlive_every_replica(tmp_path: Path) -> None:
    """The owners are in etcd: a whole group restarted (every replica SIGKILLed) still sends
    a follow-up to the backend that stores its response; without them it would not know."""
    import openai

    with group(tmp_path, shims=1, sims=3) as g:
        client = openai.OpenAI(base_url=g.shims[0].ready + "/v1", api_key="x", max_retries=0)
        made = [client.responses.create(model=MODEL, input=f"remember {i}", max_output_tokens=4)
                for i in range(4)]  # fmt: skip
        listed = g.baton("pins", "list", "--kind", "response", "--json").stdout
        owners = {p["key"]: p["backend_id"] for p in json.loads(listed)["pins"]}
        assert set(owners) == {r.id for r in made}
        for rid in list(g.replicas):
            g.stop(rid)
        for rid, old in list(g.replicas.items()):
            g.replicas[rid] = start_control_replica(
                g.etcd, rid, config=g.config, port=int(old.ready.rsplit(":", 1)[1]),
                log=tmp_path / f"{rid}.again.log",
            )  # fmt: skip
            g.parts.append(g.replicas[rid])
        leader = g.wait_leader()
        assert g.followed(leader)
        for r in made:
            follow = client.responses.create(
                model=MODEL, input="and then?", previous_response_id=r.id, max_output_tokens=2
            )
            assert follow.previous_response_id == r.id and follow.output_text
        # Each went to its owner (a sim answers 404 for a response it does not hold, and a
        # control that did not know the owner would have refused it): the new leader says so.
        routed = json.loads(g.baton("events", "--kind", "route", "--json").stdout)
        owned = [e["backend_id"] for e in routed if e["reason"] == "owner"]
        assert sorted(owned) == sorted(owners.values())


def test_replicas_serving_tls_follow_their_leader_and_its_shims_move(tmp_path: Path) -> None:
    """With --tls-cert every replica serves TLS, the soft-state stream between them too."""
    from tests.integration.test_tls import self_signed

    cert, key = self_signed(tmp_path)
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    with group(tmp_path, control_args=tls, ca=cert) as g:
        shim = start_shim(g.control, "--control-tls-ca", str(cert))
        g.shims.append(shim)
        g.parts.append(shim)
        old = g.wait_leader()

        def followers(rid: str) -> float:
            return g.metric(rid, "baton_replica_followers")

        assert wait_until(lambda: followers(old) == len(g.replicas) - 1)
        g.stop(old)
        new = g.wait_leader(not_=old)
        assert g.followed(new)
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        status, _, _ = http_full("POST", shim.ready + "/v1/completions", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
        assert status == 200
        assert wait_until(lambda: followers(new) == 1)


def test_every_replica_reads_the_engines_kv_events_so_a_new_leaders_index_is_warm(
    tmp_path: Path,
) -> None:
    with group(tmp_path, shims=1, sims=2, kv_events=True) as g:

        def blocks(rid: str) -> float:
            return g.metric(rid, "baton_kv_blocks")

        system = {"role": "system", "content": "You are a careful assistant. " * 12}
        for i in range(6):
            body = {"model": MODEL, "messages": [system, {"role": "user", "content": f"q{i}"}],
                    "max_tokens": 4}  # fmt: skip
            status, raw, _ = http_full("POST", g.shims[0].ready + "/v1/chat/completions",
                                       json.dumps(body).encode(),
                                       {"Content-Type": "application/json"})  # fmt: skip
            assert status == 200, raw
        # Each replica's own subscriptions: the same blocks on every one, the leader's or not.
        assert wait_until(lambda: blocks("c0") > 0 and
                          len({blocks(rid) for rid in g.replicas}) == 1)  # fmt: skip
        held = blocks("c0")
        old = g.wait_leader()
        g.stop(old)
        new = g.wait_leader(not_=old)
        assert blocks(new) == held  # warm the moment it leads
