"""Router-level speculative decoding through real processes: sims as draft and targets, control
binding and gating the pairs, the shim drafting and verifying
(docs/architecture.md#speculative-pairs-and-the-gate)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.client import AdminClient
from clients.procs import Part
from tests.integration.harness import (
    MODEL,
    Fleet,
    http,
    metric,
    start_control,
    start_shim,
    start_sim,
    start_sims,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.timeout(120)

AGREE = ("--draft-agree-rate", "0.4")
# A replica that is the draft's own model (its argmax agrees with the draft everywhere, so its
# acceptance spikes like the incident's) on an engine whose facts differ from the draft's.
SPIKY = {
    "block_size": (*AGREE, "--block-size", "32"),
    "tokenizer": (*AGREE, "--tokenizer-drop-merge", "300"),  # one merge fewer
}
PROMPTS = [
    "The fleet of engines",
    "Once upon a time, a router",
    "def resume(stream):",
    "Speculative decoding drafts tokens",
]


@dataclass
class SpecFleet:
    fleet: Fleet
    draft: Part

    def baton(self, *args: str) -> Any:
        return self.fleet.baton(*args)

    def ok(self, *args: str) -> Any:
        out = self.fleet.baton(*args, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def pairs(self) -> dict[str, dict[str, Any]]:
        return {p["id"]: p for p in self.ok("pairs", "list")}

    def pair_events(self) -> list[dict[str, Any]]:
        return list(self.ok("events", "--kind", "pair"))


@contextmanager
def spec_fleet(
    tmp_path: Path, targets: Sequence[Sequence[str]], draft: Sequence[str] = AGREE,
    shim_args: Sequence[str] = (),
) -> Iterator[SpecFleet]:  # fmt: skip
    parts: list[Part] = []
    try:
        *started, d = start_sims([*(("--decode-ms-per-step", "2", *e) for e in targets), draft])
        sims = {f"t{i}": p for i, p in enumerate(started)}
        parts += [*started, d]
        config = write_config(
            tmp_path / "control.toml", [(k, p.ready) for k, p in sims.items()], probe_interval=0.2
        )
        control = start_control(config)
        parts.append(control)
        shim = start_shim(control.ready, *shim_args)
        parts.append(shim)
        f = SpecFleet(Fleet(sims, control, shim, parts), d)
        f.ok("backends", "add", "d", "--url", d.ready, "--model", MODEL, "--role", "draft")
        assert wait_until(lambda: f.fleet.backends()["d"]["state"] == "healthy")
        yield f
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def direct(sim: Part, prompt: str, n: int, chat: bool = False) -> str:
    """The target alone, greedy: what the pair must reproduce byte for byte."""
    if chat:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": n, "temperature": 0}  # fmt: skip
        status, raw = http("POST", sim.ready + "/v1/chat/completions", json.dumps(body).encode())
        assert status == 200, raw
        return str(json.loads(raw)["choices"][0]["message"]["content"])
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
    status, raw = http("POST", sim.ready + "/v1/completions", json.dumps(body).encode())
    assert status == 200, raw
    return str(json.loads(raw)["choices"][0]["text"])


def direct_ids(sim: Part, prompt: str | list[int], n: int) -> tuple[list[int], list[int], str]:
    """The target alone, greedy, by token ids: (prompt ids, generated ids, text)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    status, raw = http("POST", sim.ready + "/v1/completions", json.dumps(body).encode())
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    return list(choice["prompt_token_ids"]), list(choice["token_ids"]), str(choice["text"])


def seamed(
    n: int, seam: int, first: tuple[list[int], list[int], str], then: Part
) -> str:
    """What a greedy stream cut after `seam` tokens of `first`'s output and resumed on `then`
    must read: the text of those tokens, then `then`'s own continuation of them."""
    prompt_ids, ids, _ = first
    body = json.dumps({"model": MODEL, "tokens": ids[:seam]}).encode()
    status, raw = http("POST", then.ready + "/detokenize", body)
    assert status == 200, raw
    _, _, tail = direct_ids(then, prompt_ids + ids[:seam], n - seam)
    return str(json.loads(raw)["prompt"]) + tail


def through(base_url: str, prompt: str, n: int, *, chat: bool, stream: bool) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    if chat:
        messages: Any = [{"role": "user", "content": prompt}]
        if stream:
            parts = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=n, temperature=0, stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n,
                                           temperature=0)  # fmt: skip
        return r.choices[0].message.content or ""
    if stream:
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                     temperature=0).choices[0].text  # fmt: skip


@pytest.mark.parametrize("vocab", [(), ("--byte-level",)], ids=["ascii", "bytes"])
def test_pair_output_is_byte_identical_to_the_target_alone(
    tmp_path: Path, vocab: tuple[str, ...]
) -> None:
    """Byte-level sims too: accepted tokens end mid-character, and a round's text goes out
    only up to whole characters, as the target alone would stream it."""
    with spec_fleet(tmp_path, [vocab], draft=(*AGREE, *vocab)) as f:
        bound = f.ok("pairs", "bind", "d", "t0", "-k", "4")
        assert bound["state"] == "active" and bound["target"] == "t0"
        t0 = f.fleet.sims["t0"]
        for i, prompt in enumerate(PROMPTS):
            for chat in (False, True):
                stream = bool(i % 2)
                want = direct(t0, prompt, 40, chat=chat)
                got = through(f.fleet.base_url, prompt, 40, chat=chat, stream=stream)
                assert got == want, (prompt, chat, stream)
                if vocab:
                    assert any(ord(ch) > 127 for ch in want), want  # it is multi-byte text
        # The pair really served: rounds counted, acceptance near the draft's agreement.
        assert wait_until(lambda: f.pairs()["d"]["rounds"] > 20)
        acceptance = f.pairs()["d"]["acceptance"]
        assert 0.15 < acceptance < 0.75, acceptance
        control = f.fleet.control.announced["METRICS"].removesuffix("/metrics")
        exported = metric(control, "baton_pair_acceptance_baseline", 'draft="d"')
        assert 0.15 < exported < 0.75


def test_rounds_drafted_ahead_and_of_adaptive_length_keep_the_targets_own_output(
    tmp_path: Path,
) -> None:
    """--spec-lookahead and --spec-adaptive-k: the draft proposes the next round while the
    target verifies, and rounds lengthen and shorten; the output is still the target's own,
    byte for byte, and rounds really started from a proposal drafted ahead (a guess at the
    target's bonus token that came true) as well as from fresh ones (a guess that did not)."""
    agree = ("--draft-agree-rate", "0.8")
    with spec_fleet(tmp_path, [()], draft=agree,
                    shim_args=("--spec-lookahead", "--spec-adaptive-k")) as f:  # fmt: skip
        f.ok("pairs", "bind", "d", "t0", "-k", "3")
        t0 = f.fleet.sims["t0"]
        for i, prompt in enumerate(PROMPTS):
            for chat in (False, True):
                want = direct(t0, prompt, 48, chat=chat)
                got = through(f.fleet.base_url, prompt, 48, chat=chat, stream=bool(i % 2))
                assert got == want, (prompt, chat)
        shim = f.fleet.base_url.removesuffix("/v1")
        ahead = metric(shim, "baton_shim_spec_proposals_total", 'source="ahead"')
        fresh = metric(shim, "baton_shim_spec_proposals_total", 'source="fresh"')
        assert ahead > 0 and fresh > 0, (ahead, fresh)
        # Adaptive k: rounds drafted more than the pair's k of 3 on the whole (lengthened
        # after whole takes; a fixed k drafts 3 at most, fewer near max_tokens).
        drafted = metric(shim, "baton_shim_spec_drafted_tokens_total")
        assert drafted > 3 * (ahead + fresh), (drafted, ahead + fresh)


@pytest.mark.parametrize(
    ("draft", "invariant"),
    [
        ((*AGREE, "--tokenizer-variant", "3"), "tokenizer"),  # merges left out: fewer ids
        # The same ids and texts, one merge fewer ("ne", which the probe corpus never cuts
        # into: only the vocabulary sweep sees it).
        ((*AGREE, "--tokenizer-drop-merge", "300"), "tokenizer"),
        ((*AGREE, "--block-size", "32"), "block_size"),
    ],
)
def test_bind_refuses_each_broken_invariant_by_name(
    tmp_path: Path, draft: tuple[str, ...], invariant: str
) -> None:
    with spec_fleet(tmp_path, [()], draft=draft) as f:
        out = f.baton("pairs", "bind", "d", "t0")
        assert out.returncode != 0
        assert "FAILED_PRECONDITION" in out.stderr and invariant in out.stderr, out.stderr
        assert f.pairs() == {}


def test_a_bind_on_an_engine_that_never_answers_is_refused_by_name_within_its_timeout(
    tmp_path: Path,
) -> None:
    """The facts are read within the operator's --timeout as a whole (not a fixed time per
    call): an engine that takes connections and answers nothing gets the bind refused,
    naming it, before the CLI's deadline, rather than the call cut off by that deadline."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # connections complete in the backlog; nothing is ever read or answered
    try:
        with spec_fleet(tmp_path, [()]) as f:
            url = f"http://127.0.0.1:{silent.getsockname()[1]}"
            f.ok("backends", "add", "mute", "--url", url, "--model", MODEL)
            out = f.baton("pairs", "bind", "d", "mute", "--timeout", "3")
            # Past the 3 s the CLI would say DEADLINE_EXCEEDED: a refusal is an answer in time.
            assert out.returncode != 0
            assert "FAILED_PRECONDITION" in out.stderr and "facts: mute" in out.stderr, out.stderr
            assert f.pairs() == {}
    finally:
        silent.close()


def test_engine_defaults_do_not_enter_the_pair(tmp_path: Path) -> None:
    """The draft's generation config samples (temperature 0.7 when a request leaves it
    out): the router sets every sampling parameter on the pair's calls, so the pair binds
    and serves the target's own greedy output; a request that leaves its temperature to
    the engine is served by the target alone."""
    with spec_fleet(tmp_path, [()], draft=(*AGREE, "--default-temperature", "0.7")) as f:
        f.ok("pairs", "bind", "d", "t0")
        t0 = f.fleet.sims["t0"]
        for prompt in PROMPTS[:2]:
            assert through(f.fleet.base_url, prompt, 40, chat=False, stream=True) == direct(
                t0, prompt, 40
            )
        assert wait_until(lambda: f.pairs()["d"]["rounds"] > 0)
        rounds = f.pairs()["d"]["rounds"]
        client = openai.OpenAI(base_url=f.fleet.base_url, api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40)
        assert f.pairs()["d"]["rounds"] == rounds  # no temperature: not the pair's to serve


def test_a_serving_backend_cannot_be_bound_as_a_draft(tmp_path: Path) -> None:
    with spec_fleet(tmp_path, [(), ()]) as f:
        out = f.baton("pairs", "bind", "t1", "t0")
        assert out.returncode != 0 and "role" in out.stderr, out.stderr


def stream_until_killed(
    base_url: str, prompt: str, n: int, victim: Part, before_kill: Callable[[], None]
) -> str:
    """Stream a completion and SIGKILL `victim` once some text has arrived."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    text = []
    killed = threading.Event()
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True
    ):
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if not killed.is_set() and len("".join(text)) > 10:
            before_kill()
            victim.proc.kill()
            killed.set()
    assert killed.is_set(), "the stream ended before the kill"
    return "".join(text)


@pytest.mark.parametrize("invariant", list(SPIKY))
def test_incident_replay_a_survivor_with_other_facts_is_rejected_never_served(
    tmp_path: Path, invariant: str
) -> None:
    """docs/architecture.md#speculative-pairs-and-the-gate: the bound target dies; the only survivor
    runs on an engine whose facts differ from the draft's (another block size, a tokenizer one merge
    apart) and its acceptance spikes. The gate rejects the pairing on the probe round, naming the
    fact (nothing it verified is emitted); once a matching target is back the draft is
    re-paired with it."""
    with spec_fleet(tmp_path, [(), SPIKY[invariant], ()]) as f:
        f.ok("backends", "drain", "t1")
        f.ok("backends", "drain", "t2")
        f.ok("pairs", "bind", "d", "t0")
        for prompt in PROMPTS:  # the paired baseline, on the bound target
            through(f.fleet.base_url, prompt, 40, chat=False, stream=False)
        assert wait_until(lambda: f.pairs()["d"]["baseline"] > 0)
        baseline = f.pairs()["d"]["baseline"]
        assert baseline < 0.75

        # The bound target's own output, read before it is killed: the client's first part.
        t0_ids = direct_ids(f.fleet.sims["t0"], PROMPTS[0] * 3, 300)
        # The request starts on the bound target; t1 comes back while it streams.
        with AdminClient(f.fleet.control.ready) as admin:
            text = stream_until_killed(
                f.fleet.base_url, PROMPTS[0] * 3, 300, f.fleet.sims["t0"],
                lambda: admin.undrain_backend("t1"),
            )
        # The stream completed (the SDK raises on an error event), and it is exactly what
        # the client is owed: the bound target's greedy text up to the seam, then t1's own
        # greedy continuation of it (the probe round's verified tokens were not emitted).
        def failovers() -> list[dict[str, Any]]:
            return list(f.ok("events", "--kind", "failover"))

        assert wait_until(lambda: any(e["outcome"] == "resumed" for e in failovers()))
        resumed = [
            e for e in failovers()
            if e["from_backend"] == "t0" and e["outcome"] == "resumed"
        ]  # fmt: skip
        assert [e["to_backend"] for e in resumed] == ["t1"], resumed
        seam = resumed[0]["tokens_sent"]
        assert 0 < seam < 300
        assert text == seamed(300, seam, t0_ids, f.fleet.sims["t1"]), seam
        events = f.pair_events()
        rejects = [e for e in events if e["action"] == "reject" and e["target"] == "t1"]
        assert rejects, events
        assert rejects[0]["reason"].startswith(f"{invariant}: "), rejects[0]
        assert rejects[0]["observed"] - baseline > 0.25  # the spike the incident trusted
        # Never accepted, never served: no accept/probation verdict for t1.
        assert not [
            e for e in events
            if e["target"] == "t1" and e["action"] in ("accept", "probation", "active")
        ]  # fmt: skip
        assert f.pairs()["d"]["state"] == "detached"

        # A matching target returns: the draft is re-paired with it (gated, accepted), and
        # the pair's output is the target's own greedy output again.
        f.ok("backends", "drain", "t1")
        f.ok("backends", "undrain", "t2")
        t2 = f.fleet.sims["t2"]
        for prompt in PROMPTS[:2]:
            got = through(f.fleet.base_url, prompt, 40, chat=False, stream=True)
            assert got == direct(t2, prompt, 40)
        pair = f.pairs()["d"]
        assert pair["target"] == "t2" and pair["state"] in ("active", "probation"), pair
        actions = [(e["action"], e["target"]) for e in f.pair_events()]
        assert ("accept", "t2") in actions, actions


def test_pairs_come_back_after_a_control_restart_and_from_config(tmp_path: Path) -> None:
    t0, d = start_sim(), start_sim(*AGREE)
    parts: list[Part] = [t0, d]
    config = tmp_path / "control.toml"
    backends = "".join(
        f'[[backends]]\nid = "{bid}"\nurl = "{p.ready}"\nmodel = "{MODEL}"\nrole = "{role}"\n\n'
        for bid, p, role in (("t0", t0, "serve"), ("d", d, "draft"))
    )
    config.write_text("[probes]\ninterval = 0.2\n\n" + backends)
    data = ("--data-dir", str(tmp_path / "data"))
    try:
        control = start_control(config, *data)
        parts.append(control)
        f = SpecFleet(Fleet({"t0": t0}, control, control, parts), d)
        assert wait_until(lambda: f.baton("pairs", "bind", "d", "t0", "-k", "3").returncode == 0)
        control.stop(grace=3)

        control = start_control(config, *data)  # bound at run time, kept in the data dir
        parts.append(control)
        f = SpecFleet(Fleet({"t0": t0}, control, control, parts), d)
        assert wait_until(lambda: f.pairs().get("d", {}).get("state") == "active")
        assert f.pairs()["d"]["k"] == 3 and f.pairs()["d"]["target"] == "t0"
        control.stop(grace=3)

        config.write_text(  # and from the config file, with no data dir at all
            "[probes]\ninterval = 0.2\n\n" + backends
            + '\n[[pairs]]\ndraft = "d"\ntarget = "t0"\nnum_draft_tokens = 5\n'
        )  # fmt: skip
        control = start_control(config)
        parts.append(control)
        f = SpecFleet(Fleet({"t0": t0}, control, control, parts), d)
        assert wait_until(lambda: f.pairs().get("d", {}).get("k") == 5)
    finally:
        for p in reversed(parts):
            p.stop(grace=3)


def test_a_looping_target_is_flagged_by_the_shim_and_the_draft_moves(tmp_path: Path) -> None:
    loops = ("--loop-after-len", "24", "--loop-period", "3")
    with spec_fleet(tmp_path, [loops, ()], draft=(*AGREE, *loops)) as f:
        f.ok("backends", "drain", "t1")
        f.ok("pairs", "bind", "d", "t0")
        f.ok("backends", "undrain", "t1")
        out = through(f.fleet.base_url, PROMPTS[0], 60, chat=False, stream=False)
        # The target really loops (3 tokens, some of them several characters), and the shim
        # served exactly that.
        assert any(out[-3 * n :] == out[-n:] * 3 for n in range(1, 31)), out
        assert wait_until(lambda: f.pairs()["d"]["target"] == "t1")
        rejects = [e for e in f.pair_events() if e["action"] == "reject"]
        assert rejects and "repeated n-gram" in rejects[0]["reason"], rejects


def test_a_client_leaving_mid_stream_ends_the_rounds_and_frees_its_load(tmp_path: Path) -> None:
    with spec_fleet(tmp_path, [()]) as f:
        f.ok("pairs", "bind", "d", "t0")
        client = openai.OpenAI(base_url=f.fleet.base_url, api_key="x", max_retries=0)
        stream = client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=2000, temperature=0, stream=True
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert wait_until(lambda: f.ok("status")["in_flight"] == 0)
        rounds = f.pairs()["d"]["rounds"]
        assert 0 < rounds < 2000 // 4  # it stopped drafting well before max_tokens


def test_a_target_restarted_with_another_tokenizer_is_caught_before_it_serves_the_pair(
    tmp_path: Path,
) -> None:
    """Facts are read anew when a backend rejoins: the bound target comes back on its
    address with a tokenizer one merge apart, and the next request that would use the
    pair rejects the pairing (naming the tokenizer) and is served by the target alone."""
    with spec_fleet(tmp_path, [()]) as f:
        f.ok("pairs", "bind", "d", "t0")
        old = f.fleet.sims["t0"]
        assert through(f.fleet.base_url, PROMPTS[0], 30, chat=False, stream=False) == direct(
            old, PROMPTS[0], 30
        )
        address = old.ready.removeprefix("http://")
        old.proc.kill()
        old.proc.wait()
        assert wait_until(lambda: f.fleet.backends()["t0"]["state"] != "healthy")
        new = start_sim("--decode-ms-per-step", "2", "--tokenizer-drop-merge", "300",
                        "--listen", address)  # fmt: skip
        f.fleet.parts.append(new)
        assert wait_until(lambda: f.fleet.backends()["t0"]["state"] == "healthy")

        def rejected() -> list[dict[str, Any]]:
            return [e for e in f.pair_events() if e["action"] == "reject"]

        # The prober re-reads the facts as the backend rejoins; a request arriving first
        # still meets the gate's fresh read, so either way nothing is served by the pair.
        got = through(f.fleet.base_url, PROMPTS[1], 30, chat=False, stream=True)
        assert got == direct(new, PROMPTS[1], 30)
        assert wait_until(lambda: bool(rejected()))
        assert rejected()[0]["reason"].startswith("tokenizer: "), rejected()
        assert f.pairs()["d"]["state"] == "detached"
