"""Append-only logs in blocks: what a stream holds for as long as it runs (its token ids, its
text as UTF-8), grown without reallocating what it already holds.

Why not one array or bytearray: those grow by realloc with 1/16 to 1/8 headroom, and with
dozens of streams growing at once each realloc moves a buffer and leaves the old one as a
hole in the heap that nothing growing fits any more. bench.memory measured it: the heap
held about twice the streams' bytes. Here only a tail of up to BLOCK_BYTES grows (by the
container's own C append, a few dozen ns a token); a full tail is sealed into an exact-size
block that never moves. Id blocks are all BLOCK_BYTES, text blocks BLOCK_BYTES plus at most
the chunk that filled them: when a stream ends, its blocks are holes the next stream's fit."""

# baton: pure

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence

BLOCK_BYTES = 16384  # a sealed block's size; the tail is at most this


class IdLog:
    """Token ids, 4 bytes each (array typecode "I"), as a stream generated them. Reads copy
    out, and are for seams, not for every token."""

    __slots__ = ("_sealed", "_sealed_len", "_tail")
    PER_BLOCK = BLOCK_BYTES // 4

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self._sealed: list[array[int]] = []
        self._sealed_len = 0
        self._tail = array("I", ids)
        if len(self._tail) >= self.PER_BLOCK:
            self._seal()

    def extend(self, ids: Iterable[int]) -> None:
        tail = self._tail
        tail.extend(ids)
        if len(tail) >= self.PER_BLOCK:
            self._seal()

    def _seal(self) -> None:
        tail, n = self._tail, self.PER_BLOCK
        while len(tail) >= n:
            self._sealed.append(tail[:n])  # a new array of exactly n ids
            self._sealed_len += n
            tail = tail[n:]
        self._tail = tail

    def __len__(self) -> int:
        return self._sealed_len + len(self._tail)

    def _all(self) -> array[int]:
        if not self._sealed:
            return self._tail
        out = array("I")
        for block in self._sealed:
            out.extend(block)
        out.extend(self._tail)
        return out

    def __getitem__(self, key: slice) -> array[int]:
        """ids[start:end] as a new array."""
        return self._all()[key]

    def __iter__(self) -> Iterator[int]:
        for block in self._sealed:
            yield from block
        yield from self._tail

    def tolist(self, start: int = 0, end: int | None = None) -> list[int]:
        return self._all()[start:end].tolist()

    @property
    def capacity_bytes(self) -> int:
        """What its arrays take, headers and the tail's headroom included."""
        return sum(map(sys.getsizeof, self._sealed)) + sys.getsizeof(self._tail)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IdLog) and self._all() == other._all()

    def __repr__(self) -> str:
        return f"IdLog({self.tolist()})"


class Utf8Log:
    """Text as UTF-8 bytes: a growing tail, sealed (copied to exact-size bytes) once it holds
    BLOCK_BYTES or more; chunks are not split across blocks."""

    __slots__ = ("_sealed", "_sealed_len", "_tail")

    def __init__(self) -> None:
        self._sealed: list[bytes] = []
        self._sealed_len = 0
        self._tail = bytearray()

    def extend(self, data: bytes) -> None:
        tail = self._tail
        tail += data
        if len(tail) >= BLOCK_BYTES:
            self._sealed.append(bytes(tail))  # exact size; the bytearray had headroom
            self._sealed_len += len(tail)
            self._tail = bytearray()

    def __len__(self) -> int:
        return self._sealed_len + len(self._tail)

    def bytes(self) -> bytes:
        return b"".join([*self._sealed, self._tail])

    def clear(self) -> None:
        self._sealed.clear()
        self._sealed_len = 0
        self._tail = bytearray()

    @property
    def capacity_bytes(self) -> int:
        """What its buffers take, headers and the tail's headroom included."""
        return sum(map(sys.getsizeof, self._sealed)) + sys.getsizeof(self._tail)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Utf8Log) and self.bytes() == other.bytes()
