"""Text of token ids the way a byte-level engine streams it. Baton has no tokenizer: the
engine's /detokenize decodes, and these rules say which of its answers a client may see.

vLLM (tokenizers' DecodeStream) and the sim release a token's text only once the bytes so
far decode to whole characters: a decoded text that ends in U+FFFD is half a character (or
an invalid byte still open), held back until a later token completes it. When the stream
ends, bytes of a character never completed are dropped, not sent."""

# baton: pure

from __future__ import annotations

from collections.abc import Awaitable, Callable

REPLACEMENT = "\ufffd"
# How far back the end of a stream looks for a character boundary (tokens; a character is
# at most 4 bytes, and every token has at least one).
SETTLE_TOKENS = 8


def whole(text: str) -> bool:
    """Whether decoded text ends at a character boundary (an engine would release it)."""
    return not text.endswith(REPLACEMENT)


async def settled(decode: Callable[[list[int]], Awaitable[str]], ids: list[int]) -> str:
    """The text of `ids` up to their last character boundary: what a byte-level engine has
    released when its stream ends there. Bounded: SETTLE_TOKENS + 1 decodes at most."""
    text = ""
    for cut in range(min(len(ids), SETTLE_TOKENS) + 1):
        text = await decode(ids[: len(ids) - cut]) if len(ids) > cut else ""
        if whole(text):
            return text
    return text.rstrip(REPLACEMENT)
