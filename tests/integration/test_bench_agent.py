"""`python -m bench.failover --workload agent --quick`, small: tool-calling conversations and
plain chat streams through Baton while sims are SIGKILLed. Every turn must be what an
uninterrupted stream gave (content, finish_reason, each call's name and arguments, well-formed
distinct call ids), no client sees an error, and the run must have resumed an agent stream."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.agent_judge import Turn, judge, judge_conversation


# Alone: a fleet of forked sims killed every ~0.25 s beside other tests' processes would be
# load it did not make, and the run takes ~30 s of both cores (make test runs it last).
@pytest.mark.alone
@pytest.mark.timeout(240)
def test_quick_agent_run_is_identical_through_kills(tmp_path: Path) -> None:
    out = tmp_path / "agent.json"
    argv = [sys.executable, "-m", "bench.failover", "--workload", "agent", "--quick",
            "--conversations", "8", "--concurrency", "4", "--kill-every", "0.25",
            "--json", str(out)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    assert s["conversations"] == 8 and s["agent_turns"] >= 16 and s["calls"] > 0, s
    assert s["errors"] == 0, s["bad_streams"]
    assert s["turns_identical_pct"] == 100.0, s["non_identical"]
    assert s["conversations_identical_pct"] == 100.0, s["non_identical"]
    assert s["plain_identical_pct"] == 100.0, s["non_identical"]
    assert s["failovers"]["agent"].get("resumed", 0) >= 1, (s["failovers"], run.stdout)
    assert s["failovers"]["agent"].get("refused", 0) == 0, s["failovers"]


def turn(content: str, *calls: tuple[str, str, str], finish: str = "tool_calls") -> Turn:
    t = Turn("agent", 0, 1, status=200, done=True, finish=finish)
    t.message = {"content": content, "tool_calls": [
        {"index": i, "id": cid, "type": "function", "function": {"name": n, "arguments": a}}
        for i, (cid, n, a) in enumerate(calls)]}  # fmt: skip
    return t


def test_the_judge_goes_by_what_the_client_assembled() -> None:
    ok = "chatcmpl-tool-0123456789abcdef"
    want = turn("hi", ("chatcmpl-tool-ffffffffffffffff", "f", '{"a": 1}'))
    assert judge(turn("hi", (ok, "f", '{"a": 1}')), want) == ""  # ids are the engine's to pick
    assert judge(turn("hi", (ok, "f", '{"a": 2}')), want) == "calls"
    assert judge(turn("hi", (ok, "ff", '{"a": 1}')), want) == "calls"  # a name sent twice
    assert judge(turn("hi", (ok + ok, "f", '{"a": 1}')), want) == "call_id"  # an id sent twice
    assert judge(turn("hi!", (ok, "f", '{"a": 1}')), want) == "content"
    assert judge(turn("hi", (ok, "f", '{"a": 1}'), finish="stop"), want) == "finish_reason"
    cut = turn("hi", (ok, "f", '{"a": 1}'))
    cut.done = False
    assert judge(cut, want) == "truncated"
    assert judge(None, want) == "missing"
    # The same id in two turns of one conversation fails the second.
    answer = turn("done", finish="stop")
    assert judge_conversation([turn("hi", (ok, "f", '{"a": 1}')), answer], [want, answer]) == [
        "", ""]  # fmt: skip
    again = [turn("hi", (ok, "f", '{"a": 1}')), turn("hi", (ok, "f", '{"a": 1}'))]
    assert judge_conversation(again, [want, want]) == ["", "duplicate_call_id"]
    assert judge_conversation(again[:1], [want, answer]) == ["", "missing"]
