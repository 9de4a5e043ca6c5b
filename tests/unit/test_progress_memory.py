"""What a stream holds per generated token (dataplane/relay/progress.py): ids 4 bytes each
and the client's text as UTF-8, both in block logs (blocklog.py), not one Python object per
token; and it still reads back as sent."""

from __future__ import annotations

import tracemalloc

from dataplane.relay.progress import ChoiceProgress


def test_a_long_stream_is_held_compactly_and_reads_back_whole() -> None:
    p = ChoiceProgress(0)
    texts = [f" w{i % 1000:03d}" if i % 7 else "é" for i in range(20000)]
    tracemalloc.start()
    try:
        for i, text in enumerate(texts[:10000]):
            p.add(text, [i + 300])
        before = len(tracemalloc.take_snapshot().traces)
        for i, text in enumerate(texts[10000:], start=10000):
            p.add(text, [i + 300])
        # What grows with the stream is a few blocks, not objects per chunk: 10,000 more
        # chunks added 7 allocations (a str a chunk, joined every 256, added 39).
        assert len(tracemalloc.take_snapshot().traces) - before < 10
    finally:
        tracemalloc.stop()
    # The text reads back as sent, and so do the ids, from anywhere.
    assert p.text == "".join(texts) and p.text_len == len(p.text)
    assert p.ids() == [i + 300 for i in range(20000)]
    assert p.ids(4990, 5000) == list(range(5290, 5300))
    held = p.token_ids.capacity_bytes + p.utf8.capacity_bytes
    assert held / 20000 < 12  # bytes per token; a list of ints and one str a chunk: ~100


def test_text_sent_after_a_read_and_at_the_end_keeps_its_order() -> None:
    p = ChoiceProgress(0)
    for i in range(300):
        p.add(str(i % 10), [i])
    assert p.text.endswith("789")
    p.add("x", [9999])
    p.end("stop", None, held_text="yz")
    assert p.text == "".join(str(i % 10) for i in range(300)) + "xyz"


def test_any_text_round_trips_lone_surrogates_and_replacement_characters_too() -> None:
    # A JSON "\ud83d" escape decodes to a lone surrogate; an engine's invalid UTF-8 to U+FFFD.
    texts = ["a", "\ud83d", "\ufffd", "漢字", "😀", "\udc80z"]
    p = ChoiceProgress(0)
    for i, t in enumerate(texts):
        p.add(t, [i])
    assert p.text == "".join(texts) and p.text[p.text_len - 2 :] == "\udc80z"
    p.set_text("new ✓")
    assert p.text == "new ✓"
