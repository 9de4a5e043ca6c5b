"""What a stream holds per generated token (dataplane/relay/progress.py): ids 4 bytes each
and the client's text joined in blocks, not one Python object per token; and it still
reads back as the stream was sent."""

from __future__ import annotations

import sys

from dataplane.relay.progress import PIECES_BLOCK, ChoiceProgress


def test_a_long_stream_is_held_compactly_and_reads_back_whole() -> None:
    p = ChoiceProgress(0)
    texts = [f" w{i % 1000:03d}" if i % 7 else "é" for i in range(5000)]
    for i, text in enumerate(texts):
        p.add(text, [i + 300])
    # The text reads back as sent, and so do the ids, from anywhere.
    assert p.text == "".join(texts) and p.text_len == len(p.text)
    assert p.ids() == [i + 300 for i in range(5000)] and p.ids(4990) == list(range(5290, 5300))
    # A chunk's text is not its own object for long: a block holds PIECES_BLOCK of them.
    assert len(p.pieces) == 1  # (reading the text joined them)
    q = ChoiceProgress(0)
    for i, text in enumerate(texts):
        q.add(text, [i + 300])
    assert len(q.pieces) <= 5000 // PIECES_BLOCK + PIECES_BLOCK
    assert q.token_ids.itemsize == 4
    held = sys.getsizeof(q.token_ids) + sum(sys.getsizeof(s) for s in q.pieces)
    assert held / 5000 < 16  # bytes per token; a list of ints and one str a chunk: ~100


def test_text_sent_after_a_read_and_at_the_end_keeps_its_order() -> None:
    p = ChoiceProgress(0)
    for i in range(PIECES_BLOCK + 3):
        p.add(str(i % 10), [i])
    assert p.text.endswith("678")  # a block of PIECES_BLOCK and three loose pieces
    p.add("x", [9999])
    p.end("stop", None, held_text="yz")
    assert p.text == "".join(str(i % 10) for i in range(PIECES_BLOCK + 3)) + "xyz"
