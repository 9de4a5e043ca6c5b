"""Mid-stream failover through real processes: backends die, stall or send errors while
streaming, and the client still gets one unbroken, byte-identical stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clients.procs import Part
from tests.factories import sdk
from tests.integration.harness import MODEL, Fleet, fleet, http, start_sim, wait_until

pytestmark = pytest.mark.timeout(120)

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": PROMPT}]
TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> Iterator[Part]:
    """A healthy sim of the same model: what an uninterrupted stream says."""
    sim = start_sim()
    yield sim
    sim.stop()


def uninterrupted(ref: Part, endpoint: str, **kw: Any) -> str:
    c = sdk(ref.ready + "/v1")
    if endpoint == "chat":
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **kw)
        return r.choices[0].message.content or ""
    return c.completions.create(model=MODEL, prompt=PROMPT, temperature=0, **kw).choices[0].text


def streamed(f: Fleet, endpoint: str, **kw: Any) -> tuple[str, list[Any]]:
    c = sdk(f.base_url)
    if endpoint == "chat":
        chunks = list(
            c.chat.completions.create(
                model=MODEL, messages=MESSAGES, temperature=0, stream=True, **kw
            )
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        chunks = list(
            c.completions.create(model=MODEL, prompt=PROMPT, temperature=0, stream=True, **kw)
        )
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    return text, chunks


def failovers(f: Fleet, at_least: int = 1) -> list[dict[str, Any]]:
    """The failover audit events; waits (bounded) for at least `at_least` of them, since a
    parallel seam check reports its event when it lands, which may be after the stream."""
    events: list[dict[str, Any]] = []

    def enough() -> bool:
        out = f.baton("events", "--kind", "failover", "--json")
        assert out.returncode == 0, out.stderr
        events[:] = json.loads(out.stdout)
        return len(events) >= at_least

    wait_until(enough, 5)
    return events


@pytest.mark.parametrize(
    ("endpoint", "after", "mode"),
    [
        *((e, a, "parallel") for e in ("chat", "completions") for a in (1, 12, 22)),
        # after the first token, mid-way, near the end; and the inline seam check
        ("chat", 12, "inline"),
        ("completions", 22, "inline"),
    ],
)
def test_engine_crash_mid_stream_is_invisible(
    tmp_path: Path, reference: Part, endpoint: str, after: int, mode: str
) -> None:
    want = uninterrupted(reference, endpoint, max_tokens=TOKENS)
    crash = ("--fault", f"exit-after={after}")
    with fleet(
        tmp_path, n=2, per_sim=[crash], probe_interval=60, shim_args=("--seam-mode", mode)
    ) as f:
        text, chunks = streamed(
            f, endpoint, max_tokens=TOKENS, stream_options={"include_usage": True}
        )
        # The engine process really died mid-stream (it may still be exiting: wait for it).
        assert wait_until(lambda: not f.sims["s0"].alive, 10)
        assert text == want
        assert len({ch.id for ch in chunks}) == 1 and len({ch.created for ch in chunks}) == 1
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finishes.count("length") == 1 and finishes[-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == TOKENS
        if endpoint == "chat":
            roles = [ch.choices[0].delta.role for ch in chunks if ch.choices]
            assert roles.count("assistant") == 1  # no second role delta
        (event,) = failovers(f)
        assert (event["from_backend"], event["to_backend"]) == ("s0", "s1")
        assert event["tokens_sent"] == after and event["path"] == "token"
        assert event["seam"] == ("verified" if after >= 4 else "unchecked")
        assert event["outcome"] == "resumed" and event["gap_ms"] > 0
        assert PROMPT not in json.dumps(event)


def test_sigkill_from_outside_mid_stream(tmp_path: Path, reference: Part) -> None:
    want = uninterrupted(reference, "chat", max_tokens=40)
    slow = ("--decode-ms-per-step", "10")
    with fleet(tmp_path, n=2, per_sim=[slow]) as f:
        c = sdk(f.base_url)
        text, seen = "", 0
        for ch in c.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, stream=True
        ):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
                seen += 1
                if seen == 8:
                    f.sims["s0"].kill()  # SIGKILL the engine that is serving us
        assert text == want
        (event,) = failovers(f)
        assert event["from_backend"] == "s0" and event["seam"] == "verified"


def test_control_hears_of_the_failure_while_the_resume_streams(
    tmp_path: Path, reference: Part
) -> None:
    # The resume opens on the route's fallback before control is told (its Failover call
    # waits for the resumed stream to flow): control must still demote the dead backend,
    # and hear of it before the client's stream is over (probes are too slow to).
    want = uninterrupted(reference, "completions", max_tokens=40)
    # s0 dies after 4 tokens; s1 then paces the other 36 at 100 ms each: the resumed
    # stream runs ~3.6 s, which is the room control has to hear of the failure.
    per_sim = [("--fault", "exit-after=4"), ("--decode-ms-per-step", "100")]
    with fleet(tmp_path, n=2, per_sim=per_sim, probe_interval=60) as f:
        c = sdk(f.base_url)
        text, tokens, states, after_demoted = "", 0, [], 0
        for ch in c.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, max_tokens=40, stream=True
        ):
            piece = ch.choices[0].text if ch.choices else ""
            text += piece
            tokens += bool(piece)
            if states:
                after_demoted += bool(piece)
            elif tokens == 5:  # s0 sent 4: this one is resumed bytes, from s1
                # Idle, control hears in tens of ms; 1.5 s is >10x that and still well
                # inside the ~3.6 s the resumed stream has left (checked just below).
                wait_until(lambda: f.backends()["s0"]["state"] == "demoted", 1.5)
                states.append(f.backends()["s0"]["state"])
        assert text == want
        assert states == ["demoted"]
        assert after_demoted > 0, after_demoted  # the stream was not over when it knew
        assert wait_until(lambda: not f.sims["s0"].alive, 10)
        (event,) = failovers(f)
        assert (event["from_backend"], event["to_backend"]) == ("s0", "s1")


def test_backend_dying_during_the_resume_itself(tmp_path: Path, reference: Part) -> None:
    want = uninterrupted(reference, "completions", max_tokens=TOKENS)
    # s1 and s2 die 3 tokens into their resumes, inside the 4-token seam overlap.
    per_sim = [
        ("--fault", "exit-after=6"),
        ("--fault", "exit-after=3"),
        ("--fault", "exit-after=3"),
    ]
    with fleet(tmp_path, n=4, per_sim=per_sim, probe_interval=60) as f:
        text, _ = streamed(f, "completions", max_tokens=TOKENS)
        assert text == want
        events = failovers(f, 2)
        assert events[-1]["outcome"] == "resumed" and events[-1]["to_backend"] == "s3"
        assert [e["outcome"] for e in events[:-1]] == ["failed"] * (len(events) - 1)
        assert len(events) >= 2


def test_a_resume_the_engine_fails_says_why_in_its_event(tmp_path: Path, reference: Part) -> None:
    """The engine's error type reaches the failover event: an operator reads what kind of
    error the engine sent, not only "error_event" (never its message: it may quote the
    prompt)."""
    want = uninterrupted(reference, "completions", max_tokens=TOKENS)
    # s0 dies 6 tokens in; its resume on s1 gets 3 tokens out and then an in-band error.
    per_sim = [("--fault", "exit-after=6"), ("--fault", "error-after=3")]
    with fleet(tmp_path, n=3, per_sim=per_sim, probe_interval=60) as f:
        text, _ = streamed(f, "completions", max_tokens=TOKENS)
        assert text == want
        first, last = failovers(f, 2)
        assert (first["to_backend"], first["outcome"]) == ("s1", "failed"), first
        assert first["detail"] == "error_event: InternalServerError", first
        assert (last["to_backend"], last["outcome"]) == ("s2", "resumed"), last


def test_the_seam_check_waits_for_the_resume_on_a_shared_context(
    tmp_path: Path, reference: Part
) -> None:
    """llama-server's slots share one KV cache (-c N). A parallel seam check re-prefills the
    prefix the resume shares; run beside a resume that nearly fills the context, it made
    the engine fail both ("Context size has been exceeded.": CI, tests/real/test_bytes.py).
    The check waits for the resume's end: the stream completes, and the seam is still
    checked."""
    tokens, dies = 60, 40
    want = uninterrupted(reference, "completions", max_tokens=tokens)
    prompt = sdk(reference.ready + "/v1").completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1
    )
    assert prompt.usage is not None
    # The resume alone (prompt + 60 tokens) fits; the check beside it (prompt + 36) never.
    cells = ("--kv-cells", str(prompt.usage.prompt_tokens + tokens + 4))
    # s1 paces its resume (10 ms a token): the check would come while it still runs.
    per_sim = [
        ("--fault", f"exit-after={dies}", *cells),
        ("--decode-ms-per-step", "10", *cells),
    ]
    with fleet(tmp_path, n=2, per_sim=per_sim, probe_interval=60) as f:
        text, _ = streamed(f, "completions", max_tokens=tokens)
        assert text == want
        (event,) = failovers(f)
        assert event["outcome"] == "resumed" and event["to_backend"] == "s1", event
        assert event["seam"] == "verified", event


@pytest.mark.parametrize(
    ("fault", "failure"),
    [
        ("error-after=5", "error_event"),  # vLLM's in-band error chunk on a 200 stream
        ("abort-after=5", "finish_abort"),
        ("stall-after=5", "stall"),
        ("die-after=5", "disconnect"),
        ("reset-after=5", "disconnect"),
        ("garbage", "garbage"),
    ],
)
def test_every_failure_class_is_detected_and_resumed(
    tmp_path: Path, reference: Part, fault: str, failure: str
) -> None:
    want = uninterrupted(reference, "chat", max_tokens=TOKENS)
    with fleet(
        tmp_path,
        n=2,
        per_sim=[("--fault", fault)],
        probe_interval=60,
        shim_args=("--inter-token-timeout", "0.5"),
    ) as f:
        text, _ = streamed(f, "chat", max_tokens=TOKENS)
        assert text == want
        (event,) = failovers(f)
        assert event["failure"] == failure and event["outcome"] == "resumed"


def test_n_choices_are_resumed_each(tmp_path: Path, reference: Part) -> None:
    want = uninterrupted(reference, "completions", max_tokens=TOKENS)
    with fleet(tmp_path, n=2, per_sim=[("--fault", "die-after=9")], probe_interval=60) as f:
        chunks = list(
            sdk(f.base_url).completions.create(
                model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS, n=2, stream=True
            )
        )
        texts = {
            i: "".join(
                ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i
            )
            for i in (0, 1)
        }
        assert texts == {0: want, 1: want}
        assert sorted(e["choice"] for e in failovers(f, 2)) == [0, 1]


def test_stop_string_spanning_the_seam_is_honoured(tmp_path: Path, reference: Part) -> None:
    full = uninterrupted(reference, "completions", max_tokens=TOKENS)
    stop = full[10:13]
    assert stop not in full[:10] and stop.strip()
    want = uninterrupted(reference, "completions", max_tokens=TOKENS, stop=[stop])
    assert want == full[:10]
    # Die right after the token that starts the stop string: the engine held it back.
    pieces = token_texts(reference, TOKENS)
    k = next(i for i in range(len(pieces)) if len("".join(pieces[: i + 1])) > 10)
    with fleet(tmp_path, n=2, per_sim=[("--fault", f"die-after={k + 1}")], probe_interval=60) as f:
        text, chunks = streamed(f, "completions", max_tokens=TOKENS, stop=[stop])
        assert text == want
        assert chunks[-1].choices[0].finish_reason == "stop"
        (event,) = failovers(f)
        assert event["tokens_sent"] == k + 1


def token_texts(ref: Part, n: int) -> list[str]:
    """The text of each generated token, from a stream that sends one token per chunk."""
    status, body = http(
        "POST",
        ref.ready + "/v1/completions",
        json.dumps(
            {"model": MODEL, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True}
        ).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200
    return [
        json.loads(line[6:])["choices"][0]["text"]
        for line in body.decode().splitlines()
        if line.startswith("data: {") and '"choices":[{' in line
    ]


def sse_events(body: bytes) -> list[Any]:
    return [
        json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
        for line in body.decode().splitlines()
        if line.startswith("data: ")
    ]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": 0.3}, "presence_penalty"),
        ({"guided_json": {"type": "object"}}, "guided"),
        ({"response_format": {"type": "json_object"}}, "JSON"),
    ],
)
def test_refusals_end_with_an_error_event_never_a_truncation(
    tmp_path: Path, extra: dict[str, Any], words: str
) -> None:
    with fleet(tmp_path, n=2, per_sim=[("--fault", "die-after=5")], probe_interval=60) as f:
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": TOKENS,
            "stream": True,
            "temperature": 0,
            **extra,
        }
        status, raw = http(
            "POST",
            f.base_url + "/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert words in events[-2]["error"]["message"]
        (event,) = failovers(f)
        assert event["outcome"] == "refused" and words in event["detail"]


def test_exhausted_budget_is_an_error_event(tmp_path: Path) -> None:
    dying = ("--fault", "die-after=3")
    with fleet(tmp_path, n=2, per_sim=[dying, dying], probe_interval=60) as f:
        status, raw = http(
            "POST",
            f.base_url + "/completions",
            json.dumps(
                {
                    "model": MODEL,
                    "prompt": PROMPT,
                    "max_tokens": TOKENS,
                    "stream": True,
                    "temperature": 0,
                }
            ).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert events[-2]["error"]["code"] == "backend_failed"
        assert failovers(f)[-1]["outcome"] == "exhausted"


def test_text_path_drifts_where_the_token_path_does_not(tmp_path: Path, reference: Part) -> None:
    from sim.tokenizer import build_tokenizer

    want = uninterrupted(reference, "completions", max_tokens=TOKENS)
    status, body = http(
        "POST",
        reference.ready + "/v1/completions",
        json.dumps(
            {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            }
        ).encode(),
        {"Content-Type": "application/json"},
    )
    choice = json.loads(body)["choices"][0]
    prompt_ids, ids = choice["prompt_token_ids"], choice["token_ids"]
    k = 12
    tok = build_tokenizer()
    # The cause: re-tokenizing prompt + text merges tokens the model emitted separately.
    assert prompt_ids[:1] + tok.encode(PROMPT + tok.decode(ids[:k])) != prompt_ids + ids[:k]
    crash = [("--fault", f"exit-after={k}")]
    with fleet(tmp_path / "text", n=2, per_sim=crash, probe_interval=60, kind="openai") as f:
        text, _ = streamed(f, "completions", max_tokens=TOKENS)
        (event,) = failovers(f)
        # The text seam check sees it: the new backend, fed the retokenised text, does not
        # regenerate the last chunks the client has.
        assert event["path"] == "text" and event["seam"] == "divergent"
        assert text[: len(tok.decode(ids[:k]))] == want[: len(tok.decode(ids[:k]))]
        assert text != want  # same text so far, different token history, another continuation
    with fleet(tmp_path / "token", n=2, per_sim=crash, probe_interval=60) as f:
        text, _ = streamed(f, "completions", max_tokens=TOKENS)
        assert failovers(f)[0]["path"] == "token"
        assert text == want


def teacher_forced(sim: Part, prompt_ids: list[int], prefix: list[int], n: int) -> list[int]:
    """The greedy tokens `sim` produces after exactly prompt + prefix."""
    status, body = http(
        "POST",
        sim.ready + "/v1/completions",
        json.dumps(
            {
                "model": MODEL,
                "prompt": prompt_ids + prefix,
                "max_tokens": n,
                "temperature": 0,
                "return_token_ids": True,
            }
        ).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200
    return list(json.loads(body)["choices"][0]["token_ids"])


@pytest.mark.parametrize("mode", ["parallel", "inline"])
def test_chip_noise_shows_as_divergent_seams_where_replicas_disagree(
    tmp_path: Path, mode: str
) -> None:
    noise = ("--tie-rate", "0.5")
    ref0, ref1 = start_sim(*noise, "--chip-seed", "0"), start_sim(*noise, "--chip-seed", "1")
    k, m = 12, 4
    try:
        cases: dict[str, tuple[str, list[int], list[int]]] = {}
        for i in range(40):  # bounded search for one prompt of each kind
            prompt = f"prompt number {i}"
            status, body = http(
                "POST",
                ref0.ready + "/v1/completions",
                json.dumps(
                    {
                        "model": MODEL,
                        "prompt": prompt,
                        "max_tokens": k,
                        "temperature": 0,
                        "return_token_ids": True,
                    }
                ).encode(),
                {"Content-Type": "application/json"},
            )
            ch = json.loads(body)["choices"][0]
            pids, ids0 = ch["prompt_token_ids"], ch["token_ids"]
            # Where replica 1 would disagree, teacher-forced on replica 0's tokens.
            agree = all(
                teacher_forced(ref1, pids, ids0[:j], 1) == [ids0[j]] for j in range(k - m, k)
            )
            cases.setdefault("verified" if agree else "divergent", (prompt, pids, ids0))
            if len(cases) == 2:
                break
        assert set(cases) == {"verified", "divergent"}
        for verdict, (prompt, pids, ids0) in cases.items():
            per_sim = [
                (*noise, "--chip-seed", "0", "--fault", f"exit-after={k}"),
                (*noise, "--chip-seed", "1"),
            ]
            with fleet(
                tmp_path / verdict,
                n=2,
                per_sim=per_sim,
                probe_interval=60,
                shim_args=("--seam-mode", mode),
            ) as f:
                got = sdk(f.base_url).completions.create(
                    model=MODEL, prompt=prompt, temperature=0, max_tokens=TOKENS, stream=True
                )
                text = "".join(ch.choices[0].text for ch in got)
                (event,) = failovers(f)
                assert event["seam"] == verdict
            # Either way the continuation is conditioned on exactly what the client saw.
            rest = teacher_forced(ref1, pids, ids0, TOKENS - k)
            from sim.tokenizer import build_tokenizer

            assert text == build_tokenizer().decode(ids0 + rest)
    finally:
        ref0.stop()
        ref1.stop()


def test_sampled_decoding_resumes_and_is_marked(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2, per_sim=[("--fault", "die-after=6")], probe_interval=60) as f:
        chunks = list(
            sdk(f.base_url).chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                temperature=0.8,
                seed=7,
                max_tokens=TOKENS,
                stream=True,
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        (event,) = failovers(f)
        assert event["seam"] == "sampled" and event["outcome"] == "resumed"


def test_client_disconnect_during_a_resume_cancels_everything(tmp_path: Path) -> None:
    import socket

    from tests.integration.harness import metric, wait_until

    per_sim = [("--fault", "die-after=5"), ("--decode-ms-per-step", "20")]
    with fleet(tmp_path, n=2, per_sim=per_sim, probe_interval=60) as f:
        host, port = f.shim.ready.removeprefix("http://").split(":")
        body = json.dumps(
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "stream": True, "temperature": 0}
        )
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            received = b""
            while received.count(b"data:") < 12:  # past the seam: s1 is generating
                received += sock.recv(65536)
            resumed_on = f.sims["s1"].ready
            assert metric(resumed_on, "vllm:num_requests_running") == 1
        # 2000 tokens at 20 ms would take 40 s; the resumed generation must stop now.
        assert wait_until(lambda: metric(resumed_on, "vllm:num_requests_running") == 0, 5)
        assert metric(f.sims["s0"].ready, "vllm:num_requests_running") == 0
