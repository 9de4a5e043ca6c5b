"""The one place a RequestOutcome is built (dataplane/outcomes.py)."""

from __future__ import annotations

from baton.model import RequestShape
from dataplane.outcomes import CLIENT_GONE, UNSERVED, outcome
from dataplane.prefix_chain import reply_hash

SHAPE = RequestShape("m", message_count=2, prefix_chain=(b"a" * 16, b"b" * 16))


def test_a_served_chat_answer_pins_its_reply_and_says_its_times() -> None:
    o = outcome("r", "b0", "m", 200, shape=SHAPE, started=10.0, first_byte=10.25, now=11.0,
                reply="hi", prompt_tokens=3, completion_tokens=4)  # fmt: skip
    assert (o.ok, o.http_status, o.ttft_ms, o.total_ms) == (True, 200, 250.0, 1000.0)
    assert o.reply_chain_hash == reply_hash(SHAPE.prefix_chain, "hi")
    assert (o.message_count, o.prompt_tokens, o.completion_tokens) == (2, 3, 4)


def test_no_first_byte_counts_the_whole_time_and_no_reply_pins_nothing() -> None:
    o = outcome("r", "b0", "m", 502, shape=SHAPE, started=1.0, now=1.5)
    assert (o.ok, o.ttft_ms, o.total_ms, o.reply_chain_hash) == (False, 500.0, 500.0, b"")


def test_the_bare_ends() -> None:
    gone = outcome("r", "b0", "m", CLIENT_GONE)
    assert (gone.ok, gone.http_status, gone.ttft_ms, gone.message_count) == (False, 499, 0.0, 0)
    assert not outcome("r", "", "m", UNSERVED).ok
    # A stored response's engine answering 404 (no such response) still served it.
    assert outcome("r", "b0", "", 404, ok=True).ok
