"""`python -m bench.ha`: control replicas on etcd (docs/replicas.md), loopback only, bounded
in requests and in time. A real etcd 3.5 (election timeout 500 ms: leases of 1 s), three
control replicas (`--store etcd://...`), two shims given all three, B sims.

1. Soak: N greedy streams (at least `--soak-seconds` of them) alternating between the shims,
   while sims are SIGKILLed and restarted at random (bench/chaos_fleet.py) and the leader is
   SIGKILLed once, a tenth of the way in (then restarted, as a follower). Every stream is
   checked against its uninterrupted reference; every failover a shim reported must be in the
   new leader's log; the operator's configuration must be what it was. etcd's own counters
   give its write rate over the soak.
2. Takeover: the leader SIGKILLed K times (restarted each time); the time from the SIGKILL to
   another replica answering a route.
3. Pins: C conversations through the shims, turn after turn; the share of their routes that
   followed a pin on the leader before it is SIGKILLed, and on the new leader for
   `--pin-window` seconds after it routes.
4. Route latency: a route question (unary Route) and a whole request through a shim, c=1,
   through the group's leader and through a single control (no store) on the same sims, in
   the same run, interleaved.

Prints tables and PASS/FAIL lines (benchmarks never gate) and writes JSON."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from baton.v1 import admin_pb2, admin_pb2_grpc, routing_pb2, routing_pb2_grpc
from bench import stats
from bench.chaos import audit_balance, metric_sum, summarize
from bench.chaos_fleet import (
    Fleet,
    KillLog,
    StreamRecord,
    chaos,
    chaos_schedule,
    failover_events,
    fleet_toml,
    stream_one,
)
from bench.failover import make_prompts, reference
from bench.overhead import await_serving
from bench.parts import MODEL, shim_argv
from clients.etcd_server import EtcdServer
from clients.procs import Part, StartFailed, free_port

DEFAULT_JSON = Path(__file__).parent / "results" / "ha.json"
RESTART_TRIES = 8
TAKEOVER_TARGET_S = 2.0
PIN_RATIO_TARGET = 0.9
ETCD_RATED_WRITES_S = 10_000.0  # etcd's own benchmark on modest hardware, far from its best


# -- the fleet --------------------------------------------------------------------------------
class HaFleet(Fleet):
    """bench/chaos_fleet.Fleet's sims, with a local etcd, control replicas on it and two
    shims that follow the leader; plus, for the latency comparison, a single control and a
    shim of its own on the same sims."""

    def __init__(
        self, logdir: Path, backends: int, replicas: int = 3, *, single: bool = True
    ) -> None:
        """`single`: also the single control and its shim (the latency comparison)."""
        self._init_sims(logdir, backends)
        self.etcd: EtcdServer | None = None
        try:
            self.etcd = EtcdServer(logdir / "ha.etcd", die_with_parent=True).start()
            self._config = logdir / "ha.control.toml"
            self._config.write_text(fleet_toml(self.sims))
            self.addresses = {f"c{i}": f"127.0.0.1:{free_port()}" for i in range(replicas)}
            self.replicas: dict[str, Part] = {}
            for rid in self.addresses:
                self.replicas[rid] = self._start(rid, self._replica_argv(rid))
            self.shims = [self._start(f"shim{i}", shim_argv(self.group)) for i in (0, 1)]
            if not single:
                return
            self.single = self._start(
                "single",
                [
                    "control",
                    "--config",
                    str(self._config),
                    "--listen",
                    "127.0.0.1:0",
                    "--metrics-listen",
                    "127.0.0.1:0",
                ],
            )
            self.single_shim = self._start("single-shim", shim_argv(self.single.ready))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> HaFleet:
        return self

    @property
    def group(self) -> str:
        """Every replica's address, as shims and the CLI take them."""
        return ",".join(self.addresses.values())

    def _replica_argv(self, rid: str) -> list[str]:
        assert self.etcd is not None
        return [
            "control",
            "--config",
            str(self._config),
            "--listen",
            self.addresses[rid],
            "--metrics-listen",
            "127.0.0.1:0",
            "--store",
            self.etcd.store_url,
            "--replica-id",
            rid,
        ]

    def status(self, rid: str) -> admin_pb2.GetStatusResponse | None:
        with grpc.insecure_channel(self.addresses[rid]) as ch:
            try:
                return admin_pb2_grpc.AdminServiceStub(ch).GetStatus(
                    admin_pb2.GetStatusRequest(), timeout=1.0
                )
            except grpc.RpcError:
                return None

    def leader(self, timeout: float = 15.0) -> str:
        """The replica leading, once exactly one says so."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            claims = []
            for rid, part in list(self.replicas.items()):
                s = self.status(rid) if part.alive else None
                if s is not None and s.leader == rid:
                    claims.append(rid)
            if len(claims) == 1:
                return claims[0]
            time.sleep(0.05)
        raise RuntimeError("no single leader")

    def kill_replica(self, rid: str) -> float:
        with self._lock:
            part = self.replicas[rid]
            self._others.remove(part)
        at = time.monotonic()
        part.kill()
        if part.proc.stdout:
            part.proc.stdout.close()
        return at

    def restart_replica(self, rid: str) -> None:
        for _ in range(RESTART_TRIES):
            try:
                self.replicas[rid] = self._start(rid, self._replica_argv(rid))
                return
            except StartFailed:
                time.sleep(0.25)  # its port can be briefly busy
        raise StartFailed(f"replica {rid} did not come back")

    def metrics(self, rid: str) -> str:
        return _get(self.replicas[rid].announced["METRICS"])

    def close(self) -> None:
        super().close()
        if self.etcd is not None:
            self.etcd.stop()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _cli_json(control: str, *args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "clients.cli", *args, "--json", "--control", control],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)


def _etcd_writes(fleet: HaFleet) -> float:
    """Proposals etcd committed (every put, delete, txn and lease grant goes through raft)."""
    assert fleet.etcd is not None
    text = _get(f"http://{fleet.etcd.endpoint}/metrics")
    return metric_sum(text, "etcd_server_proposals_committed_total")


# -- 1. the soak ------------------------------------------------------------------------------
@dataclass(slots=True)
class Plan:
    streams: int
    soak_seconds: float
    concurrency: int
    backends: int
    tokens: int
    kill_every: float
    takeovers: int
    conversations: int
    pin_window: float
    latency_n: int
    seed: int
    prompts: int = 16


async def soak(fleet: HaFleet, plan: Plan) -> dict[str, Any]:
    prompts = make_prompts(plan.seed, plan.prompts)
    timeout = aiohttp.ClientTimeout(total=60, sock_connect=5)
    config_before = _cli_json(fleet.group, "backends", "list")
    kills = KillLog([], [])
    leader_kill: dict[str, Any] = {}
    writes0, t0 = _etcd_writes(fleet), time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        s0 = fleet.sims["s0"].ready
        refs = await asyncio.gather(*(reference(session, s0, p, plan.tokens) for p in prompts))
        stop = asyncio.Event()
        sims = asyncio.create_task(
            chaos(fleet, chaos_schedule(plan.seed, plan.kill_every, 10_000), stop, kills)
        )
        done = [0]
        records: list[StreamRecord] = []
        end_at = t0 + plan.soak_seconds

        async def worker() -> None:
            while done[0] < plan.streams or time.monotonic() < end_at:
                i = done[0]
                done[0] += 1
                if i >= plan.streams * 20:
                    return
                p = i % len(prompts)
                body = {
                    "model": MODEL,
                    "prompt": prompts[p],
                    "max_tokens": plan.tokens,
                    "temperature": 0,
                    "stream": True,
                }
                url = fleet.shims[i % 2].ready
                records.append(await stream_one(session, url, body, StreamRecord(p)))

        async def kill_leader() -> None:
            while done[0] < plan.streams // 10:  # noqa: ASYNC110 - a count, not an event
                await asyncio.sleep(0.05)
            old = await asyncio.to_thread(fleet.leader)
            at = await asyncio.to_thread(fleet.kill_replica, old)
            new = await asyncio.to_thread(fleet.leader)
            leader_kill.update(
                old=old, new=new, at_stream=done[0], new_after_s=round(time.monotonic() - at, 3)
            )
            await asyncio.to_thread(fleet.restart_replica, old)

        killer = asyncio.create_task(kill_leader())
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(plan.concurrency):
                    tg.create_task(worker())
        finally:
            stop.set()
            await sims
            await killer
    seconds = time.monotonic() - t0
    writes = _etcd_writes(fleet) - writes0
    leader = await asyncio.to_thread(fleet.leader)
    events = await asyncio.to_thread(failover_events, fleet.addresses[leader])
    audit = await asyncio.to_thread(audit_balance, [s.ready for s in fleet.shims], len(events))
    config_after = _cli_json(fleet.group, "backends", "list")
    same_config = [(r["id"], r["url"]) for r in config_before] == [
        (r["id"], r["url"]) for r in config_after
    ]
    return {
        "summary": {**summarize(records, refs, events, plan.streams), **audit},
        "seconds": round(seconds, 1),
        "leader_kill": leader_kill,
        "sim_kills": len(kills.kills),
        "config_intact": same_config,
        "etcd_writes": writes,
        "etcd_writes_per_s": writes / seconds,
    }


# -- 2. takeover ------------------------------------------------------------------------------
def _routes(address: str) -> bool:
    shape = routing_pb2.RequestShape(model="none", message_count=1, prompt_chars=1)
    with grpc.insecure_channel(address) as ch:
        try:
            routing_pb2_grpc.RoutingServiceStub(ch).Route(
                routing_pb2.RouteRequest(request_id="takeover", shape=shape), timeout=0.5
            )
            return True
        except grpc.RpcError:
            return False


def takeovers(fleet: HaFleet, kills: int) -> list[float]:
    out = []
    for _ in range(kills):
        old = fleet.leader()
        others = [a for rid, a in fleet.addresses.items() if rid != old]
        at = fleet.kill_replica(old)
        deadline = at + 30
        took = float("nan")
        while time.monotonic() < deadline:
            if any(_routes(a) for a in others):
                took = time.monotonic() - at
                break
            time.sleep(0.005)
        out.append(took)
        fleet.restart_replica(old)
        fleet.leader()
        time.sleep(0.5)  # the restarted replica's lease and follow stream settle
    return out


# -- 3. pins ----------------------------------------------------------------------------------
def _pin_counts(fleet: HaFleet, rid: str) -> tuple[float, float]:
    """(routes that followed a pin, all routes of the model) the replica decided."""
    text = fleet.metrics(rid)
    hits = metric_sum(text, "baton_routes_total", 'reason="pin-hit"')
    total = sum(
        metric_sum(text, "baton_routes_total", f'reason="{r}"')
        for r in ("pin-hit", "spread", "spill", "repin")
    )
    return hits, total


async def pins(fleet: HaFleet, plan: Plan) -> dict[str, Any]:
    """Conversations, each turn sending everything so far: a continuation goes where its
    pin points. Measured on the leader before its SIGKILL and on the new one after."""
    timeout = aiohttp.ClientTimeout(total=30)
    convs: list[list[dict[str, str]]] = [
        [{"role": "user", "content": f"conversation {i} {hashlib.sha1(bytes([i])).hexdigest()}"}]
        for i in range(plan.conversations)
    ]
    errors = [0]

    async def turn(session: aiohttp.ClientSession, i: int) -> None:
        msgs = convs[i]
        body = {"model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0}
        url = fleet.shims[i % 2].ready + "/v1/chat/completions"
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    errors[0] += 1
                    return
                reply = (await resp.json())["choices"][0]["message"]["content"]
        except (aiohttp.ClientError, TimeoutError):
            errors[0] += 1
            return
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]

    async def rounds(session: aiohttp.ClientSession, until: float) -> int:
        n = 0
        while time.monotonic() < until:
            await asyncio.gather(*(turn(session, i) for i in range(len(convs))))
            n += 1
        return n

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(turn(session, i) for i in range(len(convs))))  # first turns
        old = await asyncio.to_thread(fleet.leader)
        h0, t0 = _pin_counts(fleet, old)
        await rounds(session, time.monotonic() + plan.pin_window / 2)
        h1, t1 = _pin_counts(fleet, old)
        # Kill it while conversations go on: the gap's turns are routed by the shims alone.
        going = asyncio.create_task(rounds(session, time.monotonic() + plan.pin_window + 5))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(fleet.kill_replica, old)
        new = await asyncio.to_thread(fleet.leader)
        h2, t2 = _pin_counts(fleet, new)
        await asyncio.sleep(plan.pin_window)
        h3, t3 = _pin_counts(fleet, new)
        await going
        await asyncio.to_thread(fleet.restart_replica, old)
    before = (h1 - h0) / (t1 - t0) if t1 > t0 else stats.NAN
    after = (h3 - h2) / (t3 - t2) if t3 > t2 else stats.NAN
    return {
        "before": before,
        "after": after,
        "routes_before": t1 - t0,
        "routes_after": t3 - t2,
        "errors": errors[0],
        "ratio": after / before if before > 0 else stats.NAN,
    }


# -- 4. route latency -------------------------------------------------------------------------
def route_latency(address: str, n: int) -> list[float]:
    """Unary Route questions at c=1 (each one's outcome reported after, untimed), in ms."""
    out = []
    with grpc.insecure_channel(address) as ch:
        stub = routing_pb2_grpc.RoutingServiceStub(ch)
        for i in range(n):
            rid = f"lat-{address}-{i}-{time.monotonic_ns()}"
            shape = routing_pb2.RequestShape(
                model=MODEL,
                message_count=1,
                prompt_chars=40,
                prefix_chain=[hashlib.sha256(rid.encode()).digest()],
            )
            t = time.perf_counter()
            resp = stub.Route(routing_pb2.RouteRequest(request_id=rid, shape=shape), timeout=5)
            out.append((time.perf_counter() - t) * 1e3)
            outcome = routing_pb2.RequestOutcome(
                request_id=rid, model=MODEL, backend_id=resp.backends[0].id if resp.backends else ""
            )
            stub.ReportOutcomes(routing_pb2.ReportOutcomesRequest(outcomes=[outcome]), timeout=5)
    return out


async def request_latency(base: str, n: int) -> list[float]:
    out = []
    body = {"model": MODEL, "prompt": "latency", "max_tokens": 1, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            t = time.perf_counter()
            async with session.post(base + "/v1/completions", json=body) as resp:
                await resp.read()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def latency(fleet: HaFleet, n: int, reps: int = 3) -> dict[str, Any]:
    rows: dict[str, list[float]] = {
        "route leader": [],
        "route single": [],
        "request leader": [],
        "request single": [],
    }
    leader = fleet.addresses[fleet.leader()]
    for _ in range(reps):  # interleaved, so a noisy moment hits both
        rows["route leader"] += route_latency(leader, n)
        rows["route single"] += route_latency(fleet.single.ready, n)
        rows["request leader"] += asyncio.run(request_latency(fleet.shims[0].ready, n))
        rows["request single"] += asyncio.run(request_latency(fleet.single_shim.ready, n))
    return {k: stats.p50_p99(v) for k, v in rows.items()}


# -- the report -------------------------------------------------------------------------------
def targets(doc: dict[str, Any]) -> list[stats.Target]:
    s = doc["soak"]["summary"]
    took = [t for t in doc["takeover_s"] if t == t]
    return [
        stats.Target("soak: client-visible errors", s["failed"], 0),
        stats.Target("soak: truncated streams", s["truncated"], 0),
        stats.Target("soak: byte-identical % of completed", s["identical_pct"], 100, True),
        stats.Target("soak: failovers reported by shims and not in the log", s["audit_lost"], 0),
        stats.Target(
            "soak: configuration intact (1 = yes)", float(doc["soak"]["config_intact"]), 1, True
        ),
        stats.Target("takeover max (s)", max(took) if took else stats.NAN, TAKEOVER_TARGET_S),
        stats.Target("pin-hit rate after / before", doc["pins"]["ratio"], PIN_RATIO_TARGET, True),
    ]


def report(doc: dict[str, Any]) -> str:
    s, soak_doc, p, lat = doc["soak"]["summary"], doc["soak"], doc["pins"], doc["latency"]
    took = [t for t in doc["takeover_s"] if t == t]
    kill = soak_doc["leader_kill"]
    rows = [
        [
            "soak streams completed / failed / truncated",
            f"{s['completed']} / {s['failed']} / {s['truncated']} of {s['sent']}",
        ],
        ["byte-identical (of completed)", f"{stats.fmt(s['identical_pct'], 1)} %"],
        ["sim SIGKILLs during the soak", str(soak_doc["sim_kills"])],
        [
            "leader SIGKILLed at stream / new leader routing after (s)",
            f"{kill.get('at_stream', '-')} ({kill.get('old', '-')} -> {kill.get('new', '-')}) / "
            f"{kill.get('new_after_s', '-')}",
        ],
        [
            "failovers in the log / reported by shims / lost",
            f"{s['failovers']} / {s['audit_reported']} / {s['audit_lost']}",
        ],
        ["configuration intact", str(soak_doc["config_intact"])],
        [
            "etcd writes over the soak (s) / per s",
            f"{soak_doc['etcd_writes']:.0f} ({soak_doc['seconds']}) / "
            f"{soak_doc['etcd_writes_per_s']:.2f}",
        ],
        [
            f"takeover p50 / max over {len(doc['takeover_s'])} leader kills (s)",
            f"{stats.fmt(stats.median(took))} / {stats.fmt(max(took) if took else stats.NAN)}",
        ],
        [
            "pin-hit rate before / after a takeover (routes)",
            f"{stats.fmt(p['before'], 3)} ({p['routes_before']:.0f}) / "
            f"{stats.fmt(p['after'], 3)} ({p['routes_after']:.0f})",
        ],
        [
            "route p50 / p99 (ms): leader of 3 vs single control",
            f"{stats.fmt(lat['route leader']['p50'], 3)} / "
            f"{stats.fmt(lat['route leader']['p99'], 3)}"
            f" vs {stats.fmt(lat['route single']['p50'], 3)} / "
            f"{stats.fmt(lat['route single']['p99'], 3)}",
        ],
        [
            "request p50 / p99 through a shim (ms): leader vs single",
            f"{stats.fmt(lat['request leader']['p50'])} / {stats.fmt(lat['request leader']['p99'])}"
            f" vs {stats.fmt(lat['request single']['p50'])} / "
            f"{stats.fmt(lat['request single']['p99'])}",
        ],
    ]
    table = stats.render_table(("metric", "value"), rows)
    return "\n".join([table, "", *stats.target_lines(targets(doc))])


def parse_args(argv: list[str] | None) -> tuple[Plan, Path]:
    p = argparse.ArgumentParser(
        prog="python -m bench.ha",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick", action="store_true", help="300 streams over 30 s, 3 takeovers, a 10 s pin window"
    )
    p.add_argument("--streams", type=int, help="soak streams (default 1000)")
    p.add_argument("--soak-seconds", type=float, help="the soak lasts at least this (300)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--backends", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--kill-every", type=float, default=1.0, help="mean s between sim kills")
    p.add_argument("--takeovers", type=int, help="leader kills timed (default 10)")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--pin-window", type=float, help="s measured after a takeover (60)")
    p.add_argument("--latency-n", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    a = p.parse_args(argv)
    q = a.quick
    plan = Plan(
        a.streams or (300 if q else 1000),
        a.soak_seconds if a.soak_seconds is not None else (30.0 if q else 300.0),
        a.concurrency,
        a.backends,
        a.tokens,
        a.kill_every,
        a.takeovers or (3 if q else 10),
        a.conversations,
        a.pin_window if a.pin_window is not None else (10.0 if q else 60.0),
        a.latency_n if not q else min(a.latency_n, 200),
        a.seed,
    )
    return plan, a.json


def main(argv: list[str] | None = None) -> int:
    plan, json_path = parse_args(argv)
    try:
        with HaFleet(json_path.parent, plan.backends) as fleet:
            for shim in (*fleet.shims, fleet.single_shim):
                await_serving(shim.ready)
            doc: dict[str, Any] = {}
            doc["latency"] = latency(fleet, plan.latency_n)
            doc["takeover_s"] = takeovers(fleet, plan.takeovers)
            doc["pins"] = asyncio.run(pins(fleet, plan))
            doc["soak"] = asyncio.run(soak(fleet, plan))
    except KeyboardInterrupt:
        print("interrupted; all parts stopped", file=sys.stderr)
        return 130
    print(report(doc))
    doc["plan"] = asdict(plan)
    doc["targets"] = [{**asdict(t), "verdict": t.verdict} for t in targets(doc)]
    stats.write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
