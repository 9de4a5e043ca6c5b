"""The Responses API through real processes, driven by the official OpenAI SDK: streamed and
whole answers, a stream that outlives its engine, stored responses routed to their owner
through any shim, and a clear error when that owner is gone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from clients.procs import Part
from tests.factories import sdk
from tests.integration.harness import MODEL, Fleet, fleet, metric, start_shim, wait_until

pytestmark = pytest.mark.timeout(120)

INPUT = "the quick brown fox"
INSTRUCTIONS = "You are terse."


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


@contextmanager
def start_shim_for(f: Fleet) -> Iterator[Part]:
    """A second shim on the same control plane."""
    shim = start_shim(f.control.ready)
    try:
        yield shim
    finally:
        shim.stop(grace=3)


def pins(f: Fleet) -> list[dict[str, Any]]:
    out = f.baton("pins", "list", "--kind", "response", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["pins"]


def route_events(f: Fleet) -> list[dict[str, Any]]:
    return json.loads(f.baton("events", "--kind", "route", "--json").stdout)


def test_a_stored_response_is_followed_up_on_its_owner_through_another_shim(
    tmp_path: Path,
) -> None:
    with fleet(tmp_path, n=2) as f, start_shim_for(f) as second:
        first = sdk(f.base_url).responses.create(
            model=MODEL, input=INPUT, max_output_tokens=8, temperature=0
        )  # store defaults to true: the response lives on the engine that made it
        assert first.status == "incomplete" and first.output_text
        ((pin,),) = [pins(f)]
        assert pin["key"] == first.id and pin["kind"] == "response"
        owner = pin["backend_id"]
        other = sdk(second.ready + "/v1")
        # Round robin would send the next requests to the other sim: ownership overrules it.
        for _ in range(2):
            follow = other.responses.create(
                model=MODEL, input="and then?", previous_response_id=first.id,
                max_output_tokens=4, temperature=0,
            )  # fmt: skip
            assert follow.previous_response_id == first.id and follow.output_text
        assert other.responses.retrieve(first.id).output_text == first.output_text
        owned = [e for e in route_events(f) if e["reason"] == "owner"]
        assert len(owned) == 3 and {e["backend_id"] for e in owned} == {owner}
        # Streamed and stored: relayed as the engine sends it, and owned the same way.
        events = events_of(other.responses.create(model=MODEL, input=INPUT, stream=True,
                                                  max_output_tokens=6, temperature=0))  # fmt: skip
        assert check_sequence(events)
        streamed_id = events[0]["response"]["id"]
        assert streamed_id in {p["key"] for p in pins(f)}
        assert sdk(f.base_url).responses.retrieve(streamed_id).id == streamed_id


def test_a_follow_up_whose_owner_is_gone_is_told_where_it_was(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2) as f:
        c = sdk(f.base_url)
        first = c.responses.create(model=MODEL, input=INPUT, max_output_tokens=4)
        (pin,) = pins(f)
        owner = pin["backend_id"]
        f.sims[owner].kill()
        assert wait_until(lambda: f.backends()[owner]["state"] == "down", 15)
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.create(model=MODEL, input="more", previous_response_id=first.id)
        message = str(err.value)
        assert first.id in message and f"backend {owner}" in message and "down" in message
        assert err.value.code == "response_owner_gone"
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.retrieve(first.id)
        assert f"backend {owner}" in str(err.value)
        f.baton("backends", "remove", owner)
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.retrieve(first.id)
        assert "removed" in str(err.value)
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.retrieve("resp_never_made")
        assert "no backend is known to hold resp_never_made" in str(err.value)
        # A new conversation is unaffected: it goes to the backend that is left.
        assert c.responses.create(model=MODEL, input=INPUT, max_output_tokens=2).output_text


def test_a_stored_stream_whose_engine_dies_ends_in_response_failed(tmp_path: Path) -> None:
    with fleet(tmp_path, n=2, per_sim=[("--fault", "die-after=5")], probe_interval=60) as f:
        events = stream(f)  # store: true, so it cannot be replayed elsewhere
        types = [e["type"] for e in events]
        assert types[0] == "response.created" and types[-1] == "response.failed"
        assert types.count("response.output_text.delta") == 5
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["id"] == events[0]["response"]["id"]
        assert "backend s0 failed mid-stream" in failed["error"]["message"]
        assert "store: true" in failed["error"]["message"]
        (event,) = failovers(f)
        assert event["outcome"] == "refused" and event["from_backend"] == "s0"
        assert event["tokens_sent"] == 5


def test_a_replayable_request_that_cannot_be_resumed_ends_in_response_failed(
    tmp_path: Path,
) -> None:
    # store:false is served as chat; the resume budget of 0 makes any resume impossible.
    with fleet(tmp_path, n=2, per_sim=[("--fault", "die-after=5")], probe_interval=60,
               shim_args=("--max-resumes", "0")) as f:  # fmt: skip
        events = stream(f, store=False)
        types = [e["type"] for e in events]
        assert types[-1] == "response.failed" and "response.completed" not in types
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "was not resumed" in events[-1]["response"]["error"]["message"]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == text
        (event,) = failovers(f)
        assert event["outcome"] == "exhausted"
