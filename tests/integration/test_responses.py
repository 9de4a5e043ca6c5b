"""The Responses API through real processes, driven by the official OpenAI SDK: streamed and
whole answers, a stream that outlives its engine, stored responses routed to their owner
through any shim, and a clear error when that owner is gone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import MODEL, Fleet, fleet, metric, wait_until

pytestmark = pytest.mark.timeout(120)

INPUT = "the quick brown fox"
INSTRUCTIONS = "You are terse."


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def events_of(stream: Any, on_delta: Any = None) -> list[dict[str, Any]]:
    out = []
    deltas = 0
    for ev in stream:
        out.append(ev.model_dump())
        if ev.type == "response.output_text.delta":
            deltas += 1
            if on_delta is not None:
                on_delta(deltas)
    return out


def check_sequence(events: list[dict[str, Any]]) -> str:
    """A valid Responses event sequence; returns its text."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types.count("response.completed") == 1
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1  # one response id, from created to completed
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert len({(d["item_id"], d["output_index"], d["content_index"]) for d in deltas}) == 1
    text = "".join(d["delta"] for d in deltas)
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == text == events[-4]["text"]
    return text


def shape(events: list[dict[str, Any]]) -> list[Any]:
    """What two runs of one greedy request must share: every event but its ids and times."""
    drop = {"id", "item_id", "created_at", "sequence_number"}

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if k not in drop}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    merged: list[Any] = []
    for e in events:  # deltas merged: a resume may cut the text into other pieces
        last = merged[-1] if merged else None
        if e["type"] == "response.output_text.delta" and isinstance(last, list):
            last[1] += e["delta"]
        elif e["type"] == "response.output_text.delta":
            merged.append(["delta", e["delta"]])
        else:
            merged.append(clean(e))
    return merged


def failovers(f: Fleet) -> list[dict[str, Any]]:
    return json.loads(f.baton("events", "--kind", "failover", "--json").stdout)


def stream(f: Fleet, on_delta: Any = None, **kw: Any) -> list[dict[str, Any]]:
    c = sdk(f.base_url)
    s = c.responses.create(model=MODEL, input=INPUT, instructions=INSTRUCTIONS, stream=True,
                           temperature=0, max_output_tokens=40, **kw)  # fmt: skip
    return events_of(s, on_delta)


def test_a_store_false_stream_is_the_chat_answer_in_responses_events(tmp_path: Path) -> None:
    with fleet(tmp_path, n=1) as f:
        events = stream(f, store=False)
        text = check_sequence(events)
        chat = sdk(f.base_url).chat.completions.create(
            model=MODEL, temperature=0, max_tokens=40,
            messages=[{"role": "system", "content": INSTRUCTIONS},
                      {"role": "user", "content": INPUT}],
        )  # fmt: skip
        assert text == chat.choices[0].message.content
        usage = events[-1]["response"]["usage"]
        assert usage["output_tokens"] == 40 and usage["input_tokens"] > 0
        assert usage["total_tokens"] == usage["input_tokens"] + 40
        # max_output_tokens ended it: the Responses API's "incomplete", as vLLM reports it.
        assert events[-1]["response"]["status"] == "incomplete"
        assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_store_false_stream_outlives_a_sigkill_of_its_engine(tmp_path: Path) -> None:
    slow = ("--decode-ms-per-step", "10")
    with fleet(tmp_path, n=2, per_sim=[slow, slow], probe_interval=60) as f:
        want = stream(f, store=False)  # uninterrupted
        served: list[str] = []

        def kill_at(n: int) -> None:
            if n == 8:
                (busy,) = [k for k, s in f.sims.items()
                           if metric(s.ready, "vllm:num_requests_running") > 0]  # fmt: skip
                served.append(busy)
                f.sims[busy].kill()

        got = stream(f, on_delta=kill_at, store=False)
        assert served and wait_until(lambda: not f.sims[served[0]].alive, 10)
        assert check_sequence(got) == check_sequence(want)
        assert shape(got) == shape(want)  # usage over the whole generation included
        (event,) = failovers(f)
        assert event["from_backend"] == served[0] and event["outcome"] == "resumed"
        assert event["path"] == "token" and event["seam"] == "verified"
