"""Append-only logs in blocks: what a stream holds for as long as it runs (its token ids, its
text as UTF-8), grown without ever reallocating what it holds.

Why not one array or bytearray: those grow by realloc with 1/16 to 1/8 headroom, and with
dozens of streams growing at once each realloc moves a buffer and leaves the old one as a
hole in the heap that nothing growing fits any more. bench.memory measured it: the heap
held about twice the streams' bytes. Here the blocks double from FIRST_BYTES up to
BLOCK_BYTES and then stay that size: each is allocated once at its full size and never
moved, and when a stream ends its blocks are holes the next streams' blocks fit exactly."""

# baton: pure

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

FIRST_BYTES = 512  # a short answer's whole log
BLOCK_BYTES = 16384  # a long one's: at most this much unused at its end


class _Log:
    """Items in blocks (block i holds min(FIRST << i, BLOCK) items), the last one filled up
    to `_fill`. Subclasses say what a block is; reads copy out and are for seams, not for
    every token."""

    __slots__ = ("_blocks", "_fill", "_len")
    ITEM: ClassVar[int]  # bytes per item

    def __init__(self) -> None:
        self._blocks: list[Any] = []
        self._fill = 0  # items in the last block
        self._len = 0

    def _block(self, n: int) -> Any:
        raise NotImplementedError

    def _room(self) -> int:
        return len(self._blocks[-1]) - self._fill if self._blocks else 0

    def _grow(self) -> Any:
        items = min(FIRST_BYTES << len(self._blocks), BLOCK_BYTES) // self.ITEM
        block = self._block(items)
        self._blocks.append(block)
        self._fill = 0
        return block

    def __len__(self) -> int:
        return self._len

    @property
    def capacity_bytes(self) -> int:
        """What the blocks hold, used or not."""
        return sum(len(b) for b in self._blocks) * self.ITEM

    def _extend(self, src: Any) -> None:
        """`src`: a sequence whose slices a block's slice can be assigned."""
        k, done = len(src), 0
        while done < k:
            room = self._room()
            block = self._blocks[-1] if room else self._grow()
            n = min(k - done, room or len(block))
            block[self._fill : self._fill + n] = src[done : done + n]
            self._fill += n
            done += n
        self._len += k

    def _parts(self, start: int, end: int) -> Iterator[Any]:
        """Slices of the blocks covering items [start:end] (0 <= start <= end <= len)."""
        at = 0
        for i, block in enumerate(self._blocks):
            size = self._fill if i == len(self._blocks) - 1 else len(block)
            lo, hi = max(start - at, 0), min(end - at, size)
            if lo < hi:
                yield block[lo:hi]
            at += size
            if at >= end:
                return

    def _bounds(self, start: int | None, end: int | None) -> tuple[int, int]:
        lo, hi, _ = slice(start, end).indices(self._len)
        return lo, max(lo, hi)

    def clear(self) -> None:
        self._blocks.clear()
        self._fill = self._len = 0


class IdLog(_Log):
    """Token ids, 4 bytes each (array typecode "I"), as a stream generated them."""

    __slots__ = ()
    ITEM = 4

    def __init__(self, ids: Sequence[int] = ()) -> None:
        super().__init__()
        if ids:
            self.extend(ids)

    def _block(self, n: int) -> array[int]:
        return array("I", [0]) * n  # allocated at its size, no headroom

    def extend(self, ids: Sequence[int]) -> None:
        if len(ids) == 1 and self._room():  # most calls: one token, and room for it
            self._blocks[-1][self._fill] = ids[0]
            self._fill += 1
            self._len += 1
            return
        self._extend(ids if isinstance(ids, array) else array("I", ids))

    def __getitem__(self, key: slice) -> array[int]:
        """ids[start:end] (step 1) as an array."""
        out = array("I")
        for part in self._parts(*self._bounds(key.start, key.stop)):
            out.extend(part)
        return out

    def __iter__(self) -> Iterator[int]:
        for part in self._parts(0, self._len):
            yield from part

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IdLog) and self[:] == other[:]

    def tolist(self, start: int = 0, end: int | None = None) -> list[int]:
        return self[start:end].tolist()

    def __repr__(self) -> str:
        return f"IdLog({self.tolist()})"


class Utf8Log(_Log):
    """Text as UTF-8 bytes."""

    __slots__ = ()
    ITEM = 1

    def _block(self, n: int) -> bytearray:
        return bytearray(n)

    def extend(self, data: bytes) -> None:
        self._extend(data)

    def bytes(self) -> bytes:
        return b"".join(self._parts(0, self._len))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Utf8Log) and self.bytes() == other.bytes()
