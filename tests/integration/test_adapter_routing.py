"""LoRA adapters through Baton (issue 42), on sims run as `vllm serve --enable-lora` with
runtime updating: a request naming an adapter reaches a replica of its base that holds it,
or one chosen to load it (once, however many requests ask at the same time); a replica holds
no more than its max_lora; an adapter Baton has never seen on an engine is refused; and a
stream for an adapter whose replica is SIGKILLed resumes, byte-identical, on the other one,
which loads it first."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.procs import Part
from control.routing.adapters import rank
from tests.factories import sdk
from tests.integration.harness import MODEL, Fleet, fleet, http, start_sim, wait_until
from tests.integration.test_sim_lora import make_adapter

pytestmark = pytest.mark.timeout(120)

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LORA = ("--enable-lora", "--max-loras", "1", "--lora-load-ms", "30")
PROMPT = "the router sent the request to"
TOKENS = 24


@pytest.fixture(autouse=True)
def runtime_updating(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines' runtime load routes are on (their environment is the test's)."""
    for k, v in RUNTIME.items():
        monkeypatch.setenv(k, v)


def adapters_toml(root: Path, names: tuple[str, ...]) -> str:
    lines = ["[lora]", "refresh = 0.2", "min_idle = 0", ""]
    for i, name in enumerate(names):
        path = make_adapter(root, name, i + 1)
        lines += ["[[adapters]]", f'name = "{name}"', f'base = "{MODEL}"', f'source = "{path}"',
                  ""]  # fmt: skip
    return "\n".join(lines)


def engine_adapters(url: str) -> set[str]:
    status, body = http("GET", url + "/v1/models")
    assert status == 200, body
    return {m["id"] for m in json.loads(body)["data"] if m.get("parent") == MODEL}


def events(f: Fleet, kind: str) -> list[dict[str, Any]]:
    out = f.baton("events", "--kind", kind, "--json")
    assert out.returncode == 0, out.stderr
    found: list[dict[str, Any]] = json.loads(out.stdout)
    return found


def complete(base_url: str, model: str, **kw: Any) -> str:
    r = sdk(base_url).completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS,
                                         temperature=0, **kw)  # fmt: skip
    return r.choices[0].text


@pytest.fixture
def lora_fleet(tmp_path: Path) -> Iterator[Fleet]:
    extra = adapters_toml(tmp_path / "adapters", ("a", "b", "c"))
    with fleet(tmp_path, 2, sim_args=LORA, control_extra=extra) as f:
        assert wait_until(lambda: all(b.get("max_adapters") == 1
                                      for b in f.backends().values()), 10)  # fmt: skip
        yield f


def test_an_adapter_is_loaded_on_demand_once_and_then_served_where_it_is_held(
    lora_fleet: Fleet, tmp_path: Path
) -> None:
    f = lora_fleet
    home = rank("a", ["s0", "s1"])[0]
    assert engine_adapters(f.sims[home].ready) == set()
    # Eight requests at once for an adapter no engine holds: one load, all served.
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: complete(f.base_url, "a"), range(8)))
    assert engine_adapters(f.sims[home].ready) == {"a"}
    other = "s1" if home == "s0" else "s0"
    assert engine_adapters(f.sims[other].ready) == set()
    loads = [e for e in events(f, "adapter") if e["action"] == "load"]
    assert [(e["backend_id"], e["adapter"], e["ok"]) for e in loads] == [
        (home, "a", True)]
    # What the adapter says, as a replica given it at start says it; not what the base says.
    ref = start_sim("--enable-lora", "--lora-modules",
                    f"a={tmp_path / 'adapters' / 'a'}")  # fmt: skip
    try:
        want = complete(ref.ready + "/v1", "a")
        base = complete(ref.ready + "/v1", MODEL)
    finally:
        ref.stop()
    assert texts == [want] * 8 and want != base
    assert complete(f.base_url, MODEL) == base
    # Later requests go where it is held: no second load.
    for _ in range(4):
        assert complete(f.base_url, "a") == want
    assert len([e for e in events(f, "adapter") if e["action"] == "load"]) == 1


def test_a_replica_holds_no_more_than_its_max_lora(lora_fleet: Fleet) -> None:
    f = lora_fleet  # control learned max_lora (1) from the engines' vllm:lora_requests_info
    for name in ("a", "b", "c", "a", "b", "c"):
        complete(f.base_url, name)
        held = [engine_adapters(p.ready) for p in f.sims.values()]
        assert all(len(h) <= 1 for h in held), held
        assert any(name in h for h in held)
    # Three adapters on two slots: some load evicted the least recently used first.
    loads = [e for e in events(f, "adapter") if e["action"] == "load"]
    assert any(d.get("evicted") for d in loads), loads


def test_an_adapter_nobody_declared_or_holds_is_refused_as_an_unknown_model(
    lora_fleet: Fleet,
) -> None:
    with pytest.raises(openai.NotFoundError):
        complete(lora_fleet.base_url, "nobody-declared-me")
    assert not [e for e in events(lora_fleet, "adapter") if e["action"] == "load"]


def test_an_adapter_stream_resumes_identical_on_a_replica_that_loads_it(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    extra = adapters_toml(root, ("a",))
    home = rank("a", ["s0", "s1"])[0]
    crash = ("--fault", "exit-after=9")
    per_sim = [crash if sid == home else () for sid in ("s0", "s1")]
    ref = start_sim("--enable-lora", "--lora-modules", f"a={root / 'a'}")
    try:
        want = complete(ref.ready + "/v1", "a")
    finally:
        ref.stop()
    with fleet(tmp_path, 2, sim_args=LORA, control_extra=extra, per_sim=per_sim,
               probe_interval=60) as f:  # fmt: skip
        chunks = list(sdk(f.base_url).completions.create(
            model="a", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True))
        assert wait_until(lambda: not f.sims[home].alive, 10)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        other = "s1" if home == "s0" else "s0"
        assert engine_adapters(f.sims[other].ready) == {"a"}
        loads = [(e["backend_id"], e["ok"]) for e in events(f, "adapter")
                 if e["action"] == "load"]  # fmt: skip
        assert loads == [(home, True), (other, True)]
        failover = events(f, "failover")
        assert failover and failover[0]["outcome"] == "resumed"
        assert failover[0]["to_backend"] == other and failover[0]["seam"] == "verified"


def test_a_replica_restarted_without_its_adapter_is_known_not_to_hold_it(
    lora_fleet: Fleet,
) -> None:
    f = lora_fleet
    home = rank("a", ["s0", "s1"])[0]
    complete(f.base_url, "a")
    assert f.backends()[home]["adapters"] == ["a"]
    port = f.sims[home].ready.rsplit(":", 1)[1]
    f.sims[home].kill()
    assert wait_until(lambda: f.backends()[home]["state"] != "healthy", 10)
    revived = Part("sim", ["sim", "--listen", f"127.0.0.1:{port}", "--model", MODEL,
                           "--instant", *LORA])  # fmt: skip
    f.parts.append(revived)
    assert wait_until(lambda: f.backends()[home]["state"] == "healthy", 10)
    assert wait_until(lambda: f.backends()[home]["adapters"] == [], 10)
    lost = [e for e in events(f, "adapter") if e["action"] == "lost"]
    assert [(e["backend_id"], e["adapter"]) for e in lost] == [(home, "a")]
    complete(f.base_url, "a")  # loaded again, where it is not held now
    assert engine_adapters(revived.ready) == {"a"}


def test_an_operator_lists_loads_and_unloads_adapters(lora_fleet: Fleet) -> None:
    f = lora_fleet
    out = f.baton("adapters", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {"a", "b", "c"} and all(r["held_by"] == [] for r in rows.values())
    stray = rank("a", ["s0", "s1"])[1]  # not where placement would put it
    out = f.baton("adapters", "load", "a", "--backend", stray, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True
    assert engine_adapters(f.sims[stray].ready) == {"a"}
    listed = {r["name"]: r for r in json.loads(f.baton("adapters", "list", "--json").stdout)}
    assert listed["a"]["held_by"] == [stray]
    # A request goes where the adapter is held, with no load of its own.
    complete(f.base_url, "a")
    loads = [e for e in events(f, "adapter") if e["action"] == "load"]
    assert [(e["backend_id"], e["reason"]) for e in loads] == [(stray, "admin")]
    out = f.baton("adapters", "unload", "a")
    assert out.returncode == 0, out.stderr
    assert engine_adapters(f.sims[stray].ready) == set()
    # A new adapter declared at run time, then served.
    missing = f.baton("adapters", "load", "nobody")
    assert missing.returncode != 0 and "declare it" in missing.stderr
    refused = f.baton("adapters", "load", "x", "--base", MODEL, "--source", "/p", "--backend",
                      "no-such-backend")  # fmt: skip
    assert refused.returncode != 0 and "no-such-backend" in refused.stderr
    listed = {r["name"] for r in json.loads(f.baton("adapters", "list", "--json").stdout)}
    assert "x" not in listed  # a refused call declared nothing
    source = rows["b"]["source"]
    out = f.baton("adapters", "load", "b2", "--base", MODEL, "--source", source, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["ok"], out.stderr
    assert complete(f.base_url, "b2") == complete(f.base_url, "b")  # the same weights


def test_a_tenant_uses_only_the_adapters_its_models_list(lora_fleet: Fleet) -> None:
    f = lora_fleet
    out = f.baton("tenants", "add", "acme", "--models", "a", "--json")
    assert out.returncode == 0, out.stderr
    key = json.loads(out.stdout)["key"]
    client = openai.OpenAI(base_url=f.base_url, api_key=key, max_retries=0, timeout=30)
    ok = lambda: client.completions.create(model="a", prompt=PROMPT, max_tokens=2)  # noqa: E731
    assert wait_until(lambda: _answers(ok), 10)
    for other in ("b", MODEL):
        with pytest.raises(openai.PermissionDeniedError):
            client.completions.create(model=other, prompt=PROMPT, max_tokens=2)
    assert not [e for e in events(f, "adapter") if e["adapter"] == "b"]  # nothing loaded


def _answers(call: Any) -> bool:
    try:
        call()
    except openai.AuthenticationError:
        return False  # the shims do not know the key yet
    return True
