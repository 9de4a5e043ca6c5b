"""What a stream holds per generated token (dataplane/relay/progress.py): ids 4 bytes each
and the client's text as UTF-8, both in block logs (blocklog.py), and the recent character
boundaries packed, not one Python object per token; and it still reads back as sent."""

from __future__ import annotations

import sys
import tracemalloc
from collections import deque

from dataplane.relay.progress import RECENT_CHUNKS, Boundaries, ChoiceProgress


def test_a_long_stream_is_held_compactly_and_reads_back_whole() -> None:
    p = ChoiceProgress(0)
    texts = [f" w{i % 1000:03d}" if i % 7 else "é" for i in range(20000)]
    tracemalloc.start()
    try:
        before = len(tracemalloc.take_snapshot().traces)
        for i, text in enumerate(texts):
            p.add(text, [i + 300])
        # No object per chunk outlives it: what the stream holds is a few dozen blocks (a
        # str a chunk, joined every 256, held 150 objects here).
        assert len(tracemalloc.take_snapshot().traces) - before < 50
    finally:
        tracemalloc.stop()
    # The text reads back as sent, and so do the ids, from anywhere.
    assert p.text == "".join(texts) and p.text_len == len(p.text)
    assert p.ids() == [i + 300 for i in range(20000)]
    assert p.ids(4990, 5000) == list(range(5290, 5300))
    held = p.token_ids.capacity_bytes + p.utf8.capacity_bytes + sys.getsizeof(p.settled._ring)
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


def test_boundaries_hold_the_latest_pairs_as_a_bounded_deque_would() -> None:
    b, d = Boundaries(), deque([(0, 0)], maxlen=RECENT_CHUNKS)
    for i in range(1, 3 * RECENT_CHUNKS + 5):
        pair = (i, 2**32 - 1 - i) if i % 5 == 0 else (i, 3 * i)
        b.append(pair)
        d.append(pair)
        assert b[-1] == d[-1] and len(b) == len(d)
        assert list(reversed(b)) == list(reversed(d))
    assert list(b) == list(d) and b[0] == d[0]
    b.clear()
    assert len(b) == 0 and list(b) == []
    b.append((7, 9))
    assert b[-1] == b[0] == (7, 9) and list(reversed(b)) == [(7, 9)]
