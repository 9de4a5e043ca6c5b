"""KV-event routing per LoRA adapter (issue 42), through real processes: two sims run as
`vllm serve --enable-lora` with both adapters loaded and KV events published (their blocks
under an adapter carry its lora_name, as vLLM's do), control indexes each adapter's blocks
apart, and the shim keys an adapter's prefix and blocks apart. So a conversation's next turn
for an adapter goes to the replica whose KV holds it, credited what that replica holds; the
same messages for another adapter, or blocks the base model cached, are credited nothing; and
a session id a client reuses across adapters is pinned once per adapter."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.client import AdminClient
from clients.procs import Part
from tests.integration.harness import MODEL, Fleet, start_control, start_shim, start_sim, wait_until
from tests.integration.test_sim_lora import make_adapter

pytestmark = pytest.mark.timeout(120)

BS = 8
LONG = "You are a careful assistant who answers in full sentences. " * 8
ADAPTERS = ("a", "b")


@pytest.fixture(autouse=True)
def runtime_updating(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines' runtime LoRA routes are on (their environment is the test's), as an
    adapter fleet runs; both adapters are loaded at start, so nothing is loaded here."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    """s0, s1: both hold adapters a and b; `ttft` routing. A tiny per-replica rate makes
    every replica an adapter's home, so its requests may go to either holder and the policy
    picks by its own signals (the KV index among them)."""
    paths = {name: make_adapter(tmp_path / "adapters", name, i + 1)
             for i, name in enumerate(ADAPTERS)}  # fmt: skip
    modules = [f"{name}={path}" for name, path in paths.items()]
    lines = ['routing = "ttft"', "[probes]", "interval = 0.2", "timeout = 0.5", "",
             "[lora]", "refresh = 0.2", "min_idle = 0", "per_replica_rate = 0.001",
             f"max_adapters = {len(ADAPTERS)}", ""]  # fmt: skip
    for name, path in paths.items():
        lines += ["[[adapters]]", f'name = "{name}"', f'base = "{MODEL}"', f'source = "{path}"',
                  ""]  # fmt: skip
    parts: list[Part] = []
    try:
        sims: dict[str, Part] = {}
        for i in range(2):
            pub, replay = f"ipc://{tmp_path}/s{i}.pub", f"ipc://{tmp_path}/s{i}.replay"
            sims[f"s{i}"] = sim = start_sim(
                "--kv-block-size", str(BS), "--kv-cache-blocks", "400",
                "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay,
                "--enable-lora", "--max-loras", str(len(ADAPTERS)), "--lora-modules", *modules,
            )  # fmt: skip
            parts.append(sim)
            lines += ["[[backends]]", f'id = "s{i}"', f'url = "{sim.ready}"', f'model = "{MODEL}"',
                      f'kv_events = "{pub}"', f'kv_events_replay = "{replay}"', ""]  # fmt: skip
        (tmp_path / "control.toml").write_text("\n".join(lines))
        control = start_control(tmp_path / "control.toml")
        parts.append(control)
        shim = start_shim(control.ready)
        parts.append(shim)
        f = Fleet(sims, control, shim, parts)

        with AdminClient(control.ready, timeout=10.0) as admin:

            def ready() -> bool:
                return all(r.kv_index == "live" and set(ADAPTERS) <= set(r.adapters)
                           for r in admin.list_backends())  # fmt: skip

            assert wait_until(ready, 15), admin.list_backends()
            yield Lab(f, admin)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


@dataclass
class Lab:
    """The fleet, and control's admin API in this process (a CLI process per look costs
    seconds on a busy machine)."""

    fleet: Fleet
    admin: AdminClient

    def route_of(self, request_id: str) -> dict[str, Any]:
        (row,) = self.admin.events(kind="route", request_id=request_id)
        return row

    def blocks(self) -> dict[str, int]:
        return {r.id: r.kv_blocks for r in self.admin.list_backends()}


def uncached(route: dict[str, Any]) -> int:
    m = re.search(r"uncached (\d+) tok", route["detail"])
    assert m, route
    return int(m.group(1))


def chat(
    lab: Lab, model: str, messages: list[dict[str, str]], session: str = ""
) -> tuple[dict[str, Any], str]:
    """The route control chose for one streamed chat turn, and the reply."""
    c: Any = openai.OpenAI(base_url=lab.fleet.base_url, api_key="x", max_retries=0)
    headers = {"x-session-id": session} if session else None
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=messages, temperature=0, max_tokens=12, stream=True,
        extra_headers=headers,
    )  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
    return lab.route_of(raw.headers["x-request-id"]), text


def warmed(lab: Lab, model: str, system: str) -> tuple[str, list[dict[str, str]]]:
    """A first turn for `model`; once its replica's KV index holds its blocks, where it went
    and the conversation's next turn."""
    before = lab.blocks()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    route, reply = chat(lab, model, messages)
    home = route["backend_id"]
    # Prompt and reply blocks, stored under the model's adapter (or none), are indexed.
    assert wait_until(lambda: lab.blocks()[home] >= before[home] + 8, 10), (model, lab.blocks())
    return home, [*messages, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "go on"}]  # fmt: skip


def test_an_adapters_next_turn_goes_where_its_kv_is_and_others_caches_do_not_count(
    lab: Lab,
) -> None:
    # Each model's first turn on an unrelated conversation: control learns each one's
    # characters per token, so the estimates below compare like with like.
    for model in (MODEL, *ADAPTERS):
        warmed(lab, model, f"Unrelated preamble for {model}. " * 10)

    # Adapter a: its next turn goes to the replica that holds the conversation's blocks under
    # a, credited them.
    home, turn = warmed(lab, "a", LONG)
    warm, _ = chat(lab, "a", turn)
    assert warm["backend_id"] == home and warm["reason"] == "predicted", warm
    # The same messages for adapter b: a's blocks are not b's (an engine shares none between
    # adapters), so nothing is credited; the whole prompt is uncached wherever b goes.
    other, _ = chat(lab, "b", turn)
    assert uncached(other) >= uncached(warm) + 10 * BS, (warm["detail"], other["detail"])

    # The base model's cached conversation is credited to the base's next turn, and not to
    # adapter a's request with the very same messages.
    base_home, base_turn = warmed(lab, MODEL, LONG + " Base.")
    base_warm, _ = chat(lab, MODEL, base_turn)
    assert base_warm["backend_id"] == base_home and base_warm["reason"] == "predicted"
    as_a, _ = chat(lab, "a", base_turn)
    assert uncached(as_a) >= uncached(base_warm) + 10 * BS, (base_warm["detail"], as_a["detail"])


def test_a_session_id_reused_across_adapters_is_pinned_once_per_adapter(lab: Lab) -> None:
    """A replica holds a conversation's KV cache under one adapter only, so a client that
    reuses one session id for two adapters (and the base model) gets a session pin for each,
    keyed by adapter; the base model's is the client's own key, as before."""
    messages = [{"role": "user", "content": "hello there"}]
    for model in ("a", "b", MODEL, "a"):
        chat(lab, model, messages, session="conv-1")
    rows, _ = lab.admin.pins(kind="session")
    assert sorted(r["key"] for r in rows) == ["conv-1", "lora:a:conv-1", "lora:b:conv-1"]
