"""The block logs a stream's ids and text live in (dataplane/relay/blocklog.py) read back
exactly what was appended, however the appends fall across blocks, and keep what they hold
in sealed blocks of one size that never grow."""

from __future__ import annotations

import random
from array import array

from dataplane.relay.blocklog import BLOCK_BYTES, IdLog, Utf8Log


def test_ids_read_back_from_anywhere_across_block_edges() -> None:
    rng = random.Random(5)
    log, ref = IdLog(), []
    while len(ref) < 3 * BLOCK_BYTES // 4 + 17:
        ids = [rng.randrange(2**32) for _ in range(rng.choice([1, 1, 1, 2, 3, 700]))]
        log.extend(ids if rng.random() < 0.5 else array("I", ids))
        ref.extend(ids)
        assert len(log) == len(ref)
    assert log.tolist() == ref and list(log) == ref and log[:] == array("I", ref)
    edge = BLOCK_BYTES // 4
    for start, end in [(0, 1), (edge - 1, edge + 1), (5, None), (len(ref) - 3, None),
                       (-3, None), (-10, -4), (100, 50), (0, 0)]:  # fmt: skip
        assert log[start:end].tolist() == ref[start:end], (start, end)
        assert log.tolist(start, end) == ref[start:end]
    assert IdLog(ref).tolist() == ref  # built whole, as a resume's plan does


def test_what_is_held_is_sealed_in_blocks_of_one_size_that_never_move() -> None:
    log = IdLog()
    for i in range(BLOCK_BYTES):  # 4 bytes an id: several blocks
        log.extend([i])
    sealed = list(log._sealed)  # noqa: SLF001
    assert sealed and {len(b) * 4 for b in sealed} == {BLOCK_BYTES}
    log.extend(range(10))
    assert all(a is b for a, b in zip(sealed, log._sealed, strict=False))  # noqa: SLF001
    assert log.capacity_bytes < 4 * len(log) + BLOCK_BYTES  # slack: the tail's headroom


def test_text_reads_back_whole_and_clears() -> None:
    log, ref = Utf8Log(), b""
    for i in range(2000):
        piece = f"tok{i} ".encode() * (1 + i % 13)
        log.extend(piece)
        ref += piece
    assert log.bytes() == ref and len(log) == len(ref)
    assert log.capacity_bytes < len(ref) + 2 * BLOCK_BYTES
    log.clear()
    log.extend(b"again")
    assert log.bytes() == b"again" and len(log) == 5
