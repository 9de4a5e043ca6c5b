"""Edges of the stream path through real processes: a stream that fails after its last
token but before its finish, a resume that a healthy backend refuses with a 4xx, and a
whole (non-streamed) answer that is not an answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.procs import Part
from tests.integration.harness import MODEL, fleet, http, metric, start_sim, wait_until
from tests.integration.test_limits import FakeBackend, custom_fleet

pytestmark = pytest.mark.timeout(90)

PROMPT = "the quick brown fox"
TOKENS = 16
HOLD_STOP = "@@@@"  # never generated: the engine holds back 3 characters for it, then lets go


@pytest.fixture(scope="module")
def reference() -> Iterator[Part]:
    sim = start_sim()
    yield sim
    sim.stop()


def post_json(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    return http("POST", url, json.dumps(body).encode(), {"Content-Type": "application/json"})


def sse_objects(raw: bytes) -> list[Any]:
    return [
        "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
        for line in raw.decode().splitlines()
        if line.startswith("data: ")
    ]


def events_of(base: str) -> list[Any]:
    """Events of a real stream as the engine would send them (token ids included)."""
    status, raw = post_json(
        base + "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
         "stream": True, "return_token_ids": True},
    )  # fmt: skip
    assert status == 200
    return sse_objects(raw)


def lost_finish(recorded: list[Any], hold: int) -> list[bytes]:
    """The recorded stream, cut as if the engine died after its last token but before the
    finish: every token sent, no finish_reason, no [DONE]. With stop strings the engine
    would still be holding back its last `hold` characters (released with the finish)."""
    chunks = [e for e in recorded if e != "[DONE]" and e["choices"]]
    full = "".join(c["choices"][0]["text"] for c in chunks)
    last = chunks[-1]["choices"][0]
    last["text"] = full[len(full) - len(last["text"]) : len(full) - hold]
    last["finish_reason"] = None
    last.pop("stop_reason", None)
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]


@pytest.mark.parametrize("stop", [None, HOLD_STOP])
def test_every_token_sent_before_the_failure_finishes_with_length(
    tmp_path: Path, reference: Part, stop: str | None
) -> None:
    extra = {"stop": [stop]} if stop else {}
    status, raw = post_json(
        reference.ready + "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, **extra},
    )
    want = json.loads(raw)["choices"][0]["text"]
    status, raw = post_json(
        reference.ready + "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
         "stream": True, "return_token_ids": True, **extra},
    )  # fmt: skip
    script = lost_finish(sse_objects(raw), len(stop) - 1 if stop else 0)
    dying = FakeBackend(lambda n, body: script)
    spare = start_sim()
    try:
        with custom_fleet(tmp_path, [("f0", dying.url), ("s1", spare.ready)],
                          probe_interval=60) as (_, shim):  # fmt: skip
            c = openai.OpenAI(base_url=shim.ready + "/v1", api_key="x", max_retries=0)
            chunks = list(
                c.completions.create(
                    model=MODEL, prompt=PROMPT, temperature=0, max_tokens=TOKENS, stream=True,
                    stream_options={"include_usage": True}, **extra,  # type: ignore[arg-type]
                )
            )  # fmt: skip
            assert len(dying.requests) == 1  # the stream really went to the dying engine
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
            finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
            assert finishes.count("length") == 1 and finishes[-1] == "length"
            assert chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == TOKENS
            # No resume was asked of the spare engine (it would have been for 0 tokens).
            assert metric(spare.ready, "vllm:prompt_tokens_total") == 0
    finally:
        spare.stop()
        dying.close()


def failovers(base: Any, at_least: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    def enough() -> bool:
        out = base.baton("events", "--kind", "failover", "--json")
        events[:] = json.loads(out.stdout) if out.returncode == 0 else []
        return len(events) >= at_least

    wait_until(enough, 5)
    return events


def stream_completion(base_url: str) -> list[Any]:
    status, raw = post_json(
        base_url + "/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
         "stream": True},
    )  # fmt: skip
    assert status == 200
    return sse_objects(raw)


def test_a_resume_refused_with_4xx_moves_on_without_demoting(
    tmp_path: Path, reference: Part
) -> None:
    _, raw = post_json(
        reference.ready + "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0},
    )
    want = json.loads(raw)["choices"][0]["text"]
    per_sim = [("--fault", "die-after=5"), ("--fault", "status=400"), ()]
    with fleet(tmp_path, n=3, per_sim=per_sim, probe_interval=60) as f:
        events = stream_completion(f.base_url)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == want
        audit = failovers(f, 2)
        assert [(e["to_backend"], e["outcome"]) for e in audit] == [
            ("s1", "failed"),
            ("s2", "resumed"),
        ]
        assert "400" in audit[0]["detail"]
        assert all(e["from_backend"] == "s0" and e["failure"] == "disconnect" for e in audit)
        states = {k: v["state"] for k, v in f.backends().items()}
        assert states == {"s0": "demoted", "s1": "healthy", "s2": "healthy"}


def test_a_resume_refused_everywhere_ends_in_an_error_event(tmp_path: Path) -> None:
    per_sim = [("--fault", "die-after=5"), ("--fault", "status=400")]
    with fleet(tmp_path, n=2, per_sim=per_sim, probe_interval=60) as f:
        events = stream_completion(f.base_url)
        assert events[-1] == "[DONE]" and "error" in events[-2]  # never a truncation
        message = events[-2]["error"]["message"]
        assert "s1" in message and "400" in message
        assert failovers(f, 2)[-1]["outcome"] == "exhausted"
        assert f.backends()["s1"]["state"] == "healthy"


def test_a_garbled_whole_answer_is_retried_on_the_next_backend(
    tmp_path: Path, reference: Part
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    _, raw = post_json(reference.ready + "/v1/completions", body)
    want = json.loads(raw)["choices"][0]["text"]
    with fleet(tmp_path, n=2, per_sim=[("--fault", "garbage")], probe_interval=60) as f:
        status, raw = post_json(f.base_url + "/completions", body)
        assert status == 200
        assert json.loads(raw)["choices"][0]["text"] == want
        assert f.backends()["s0"]["state"] == "demoted"
