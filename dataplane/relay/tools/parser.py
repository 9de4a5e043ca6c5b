"""What a tool parser tells Baton (pure): for the text a model generated after its
reasoning, what an engine's streaming parser has made of it, as the client assembles it.

Baton does not mirror an engine's parser delta for delta. It re-parses the whole text at
each resumed chunk and sends the difference from what the client already has, so all a
parser must get right is the assembled result, and that it only ever grows:

- `parse(text, final=True)` of a whole generation is what vLLM's streaming parser
  assembles for it: the content deltas joined, and per call (in `index` order) its name
  and its `arguments` deltas joined.
- Monotone: for a prefix t of a text u, parse(t).content is a prefix of parse(u).content,
  a call's name once given never changes, and a call's arguments are a prefix of its
  arguments in parse(u). So a parser holds back what it cannot yet decide (text that could
  start a tag, an arguments tail that may be dropped or rewritten).

The text is what a stream shows: special tokens skipped unless the request keeps them."""

# baton: pure

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call as far as it is decided: its name (None until whole) and the leading part of
    its arguments string that can no longer change."""

    name: str | None
    arguments: str = ""
    complete: bool = False  # its text is closed: `arguments` is final


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str  # the content the client assembles (never the text of a call)
    calls: tuple[ParsedCall, ...] = ()


NOTHING = Parsed("")


class ToolParser(Protocol):
    """One engine tool parser's assembled output (module docstring). Built per request,
    from the request's `tools` (some parsers type the arguments by the tools' schemas)."""

    def parse(self, text: str, *, final: bool = False) -> Parsed:
        """`final`: the generation ended with this text (a parser then flushes what it held
        back, as vLLM's does at the end of a stream)."""
        ...


Tools = Sequence[Mapping[str, Any]]  # the request's `tools`, as the client sent them


def held_back(text: str, *tags: str) -> int:
    """How many characters at the end of `text` could be the start of one of `tags`: what a
    parser holds back until the next text says whether a tag begins there."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best
