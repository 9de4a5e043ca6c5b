"""Speculative pairs on real engines: `baton pairs bind` reads both backends' facts from what
vLLM 0.32 and llama-server publish (no /server_info) and binds two replicas whose tokenizers
and block sizes match; it refuses, naming the invariant, a tokenizer one merge apart, one
added token apart, another vocabulary and another KV block size. A bound pair serves
router-level speculative decoding whose output is the target's own greedy output.

Run: .venv/bin/pytest -m real tests/real/test_pairs.py"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from clients.client import AdminClient
from control.pairs.table import PROBATION_ROUNDS
from scripts.engines.replicas import Engine
from tests.integration.harness import Fleet, http, metric, wait_until
from tests.real.conftest import OTHER_BLOCK_SIZE, Pool, baton, sdk
from tests.real.streams import KILL_AFTER, decode

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

DRAFT = "v0"  # tiny, as the draft of every pair below
PROMPTS = ["The fleet of engines", "def resume(stream):", "Once upon a time, a router"]


def ok(fleet: Fleet, *args: str) -> Any:
    out = fleet.baton(*args, "--json", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def story(fleet: Fleet, tmp_path: Path) -> str:
    """What a failure message needs: the health and pair events, and what the shim logged."""
    events = [str(e) for kind in ("health", "pair") for e in ok(fleet, "events", "--kind", kind)]
    return "\n".join([*events, (tmp_path / "shim.log").read_text()])


def healthy(fleet: Fleet, *names: str) -> bool:
    states = {b["id"]: b["state"] for b in ok(fleet, "backends", "list")}
    return all(states.get(n) == "healthy" for n in names)


def test_pairs_bind_on_real_vllm_and_serve_the_targets_own_greedy_output(
    pool: Pool, tmp_path: Path
) -> None:
    draft, target = pool.get(DRAFT, "v1")
    with baton(tmp_path, [draft, target], roles={DRAFT: "draft"}) as fleet:
        assert wait_until(lambda: healthy(fleet, DRAFT, "v1"), timeout=60)
        bound = ok(fleet, "pairs", "bind", DRAFT, "v1", "-k", "4")
        assert bound["state"] == "active" and bound["target"] == "v1", bound
        client, direct = sdk(fleet.base_url), sdk(target.url + "/v1")
        for prompt in PROMPTS:
            for stream in (False, True):
                kw: dict[str, Any] = dict(model=target.model, prompt=prompt, max_tokens=48,
                                          temperature=0)  # fmt: skip
                want = direct.completions.create(**kw).choices[0].text
                if stream:
                    chunks = client.completions.create(stream=True, **kw)
                    got = "".join(c.choices[0].text for c in chunks if c.choices)
                else:
                    got = client.completions.create(**kw).choices[0].text
                assert got == want, (prompt, stream)
        # The pair really served (rounds counted), and the draft is the target's own model.
        pair = {p["id"]: p for p in ok(fleet, "pairs", "list")}[DRAFT]
        assert pair["rounds"] > 0 and pair["acceptance"] == pytest.approx(1.0), pair


@pytest.mark.parametrize(
    ("target", "invariant", "detail"),
    [
        ("pm", "tokenizer", "vocab_size 263 != 264"),  # one merge ("h" "e" -> "he") more
        ("pa", "tokenizer", "vocab_size 263 != 264"),  # one added token more
        ("t0", "tokenizer", "vocab_size 263 != 265"),  # another vocabulary (tiny-think)
        ("pb", "block_size", f"128 != {OTHER_BLOCK_SIZE}"),
    ],
)
def test_bind_on_real_vllm_refuses_each_mismatch_by_name(
    pool: Pool, tmp_path: Path, target: str, invariant: str, detail: str
) -> None:
    engines = pool.get(DRAFT, target)
    with baton(tmp_path, engines, roles={DRAFT: "draft"}) as fleet:
        assert wait_until(lambda: healthy(fleet, DRAFT, target), timeout=60)
        out = fleet.baton("pairs", "bind", DRAFT, target, "--timeout", "60")
        assert out.returncode != 0
        assert "FAILED_PRECONDITION" in out.stderr, out.stderr
        assert f"{invariant}: " in out.stderr and detail in out.stderr, out.stderr
        # Only that invariant: the rest of the facts were read and agree.
        others = {"engine", "tokenizer", "block_size", "params_hash"} - {invariant}
        assert not [o for o in others if f"{o}: " in out.stderr], out.stderr
        assert ok(fleet, "pairs", "list") == []


def test_llama_server_facts_are_read_and_the_pair_refused_for_its_api(
    pool: Pool, tmp_path: Path
) -> None:
    """llama-server publishes what a bind needs (its tokenizer through /tokenize with pieces
    and /detokenize, n_vocab), so the facts of two replicas agree; its OpenAI API returns no
    token ids to compare a draft's with, so the bind is refused for that alone."""
    engines = pool.get("l0", "l1")
    with baton(tmp_path, engines, roles={"l0": "draft"}) as fleet:
        assert wait_until(lambda: healthy(fleet, "l0", "l1"), timeout=60)
        out = fleet.baton("pairs", "bind", "l0", "l1", "--timeout", "60")
        assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr, out.stderr
        assert "engine: draft is openai, target is openai" in out.stderr, out.stderr
        for other in ("tokenizer: ", "block_size: ", "facts: "):
            assert other not in out.stderr, out.stderr


def greedy_ids(engine: Engine, prompt: str | list[int], tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of the engine's own greedy completion."""
    body = {"model": engine.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    status, raw = http("POST", engine.url + "/v1/completions", json.dumps(body).encode(),
                       {"Content-Type": "application/json"})  # fmt: skip
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    return list(choice["prompt_token_ids"]), list(choice["token_ids"])


@pytest.mark.parametrize(
    ("survivor", "verdict"),
    [("k0", "accept"), ("pb", f"block_size: 128 != {OTHER_BLOCK_SIZE}")],
    ids=["facts-match", "other-block-size"],
)
def test_gate_incident_on_real_vllm(
    pool: Pool, tmp_path: Path, survivor: str, verdict: str
) -> None:
    """docs/architecture.md#speculative-pairs-and-the-gate's incident with real processes: a pair is
    bound and serving; its target is SIGKILLed mid-stream and control re-pairs the draft with the
    only survivor. Where the survivor's facts match, the probe round is judged and accepted and the
    pair serves on; where they do not (another KV block size), the re-pair is rejected naming the
    fact and the stream goes on target-only. Either way the client's text is exactly what it is
    owed: the bound target's greedy output up to the cut, then the survivor's own greedy
    continuation of those ids."""
    draft, target, other = pool.get(DRAFT, "v1", survivor)
    with baton(tmp_path, [draft, target, other], roles={DRAFT: "draft"}) as fleet:
        assert wait_until(lambda: healthy(fleet, DRAFT, "v1", survivor), timeout=60)
        ok(fleet, "backends", "drain", survivor)  # the stream starts on the bound target
        ok(fleet, "pairs", "bind", DRAFT, "v1", "-k", "4")
        client = sdk(fleet.base_url)
        for prompt in PROMPTS:  # the paired baseline, on the bound target
            client.completions.create(model=target.model, prompt=prompt, max_tokens=24,
                                      temperature=0)  # fmt: skip
        assert ok(fleet, "pairs", "list")[0]["rounds"] > 0
        # Long enough for the survivor's probation to end after the cut: PROBATION_ROUNDS rounds
        # in line with the baseline, and this pair agrees, so a round emits about k + 1 = 5
        # tokens (8 a round leaves room for the cut, the probe round and slower rounds).
        prompt, tokens = PROMPTS[0] * 4, 8 * PROBATION_ROUNDS
        prompt_ids, want = greedy_ids(target, prompt, tokens)
        text: list[str] = []
        killed = False
        with AdminClient(fleet.control.ready) as admin:
            kw: dict[str, Any] = dict(model=target.model, prompt=prompt, max_tokens=tokens)
            stream = client.completions.create(temperature=0, stream=True, **kw)
            for n, chunk in enumerate(stream):
                text += [c.text for c in chunk.choices]
                if n == KILL_AFTER:
                    admin.undrain_backend(survivor)
                    target.kill(signal.SIGKILL)
                    killed = True
        assert killed, f"the stream ended after {len(text)} chunks: {story(fleet, tmp_path)}"
        pool.revive("v1")
        evs: list[dict[str, Any]] = []

        def reported() -> bool:  # the shim reports a failover after the fact, off the stream
            evs[:] = [e for e in ok(fleet, "events", "--kind", "failover")
                      if e["from_backend"] == "v1"]  # fmt: skip
            return bool(evs)

        assert wait_until(reported, timeout=60), f"no failover from v1: {story(fleet, tmp_path)}"
        assert [(e["to_backend"], e["outcome"]) for e in evs] == [(survivor, "resumed")], evs
        cut = int(evs[0]["tokens_sent"])
        assert 0 < cut < tokens
        _, tail = greedy_ids(other, prompt_ids + want[:cut], tokens - cut)
        assert "".join(text) == decode(want[:cut] + tail), f"cut after {cut} tokens"
        pair_events = [e for e in ok(fleet, "events", "--kind", "pair")
                       if e["target"] == survivor]  # fmt: skip
        actions = [e["action"] for e in pair_events]
        outages = metric(fleet.shim.ready, "baton_shim_control_outages_total")
        if verdict == "accept":
            # story() (read only on failure) holds the pair events too.
            accepted = "accept" in actions and "reject" not in actions
            assert accepted, (outages, story(fleet, tmp_path))
            pair = ok(fleet, "pairs", "list")[0]
            assert pair["target"] == survivor and pair["state"] == "active", pair
        else:
            rejects = [e for e in pair_events if e["action"] == "reject"]
            assert len(rejects) == 1, (outages, story(fleet, tmp_path))
            (reject,) = rejects
            assert reject["reason"].startswith(verdict), reject
            assert not {"accept", "probation", "active"} & set(actions), pair_events
            assert ok(fleet, "pairs", "list")[0]["state"] == "detached"
