"""Byte-level BPE tokenizer for the toy model.

Ids 0..255 are raw bytes, 256..261 are special tokens, 262+ are merges built
in code from a fixed list of English fragments. Because merges exist, text that
the model emitted as several small tokens can re-encode to fewer, larger ones —
the retokenization drift that makes text-level resume unfaithful
(docs/architecture.md#resume-protocol).

A non-zero ``variant`` leaves out every 16th merge target (which ones depends
on the variant), so ids and pieces shift: a different vocabulary with a
different ``vocab_hash``, for testing that pairs refuse mismatched tokenizers.
Variants equal mod 16 are the same vocabulary. ``drop_merge`` keeps the vocabulary and
leaves out the one merge that makes a given token: a tokenizer one merge apart.

``byte_level=True`` adds merges for multi-byte UTF-8 fragments, the way a
byte-level BPE (Llama 3, Qwen) has them: whole characters as one token ("é",
"中", "😀"), their intermediate pieces (a lead byte plus continuation bytes,
b"\\xe4\\xb8", b"\\xf0\\x9f\\x98"), and a space followed by a lead byte
(b" \\xe4"). Ids of the ASCII merges stay as they are; the new ones follow, so
it is a different vocabulary (and ``vocab_hash``).

``reasoning=True`` adds two *added* tokens after the merges, ``<think>`` and
``</think>`` (DeepSeek-R1 style): encode() maps their strings to them like the
specials, but they are not special, so ``skip_special_tokens`` keeps their
text in decoded output. With ``think_special=True`` they are special tokens
instead (as some reasoning models' tokenizers mark them): the same ids, but
``skip_special_tokens`` decoding (a stream's, by default) drops their text,
while a plain decode (/detokenize) still spells them.

A request with ``skip_special_tokens: false`` (its own, or a tool parser's:
sim.adjust) decodes with every piece's bytes, specials included
(``shown(False)``): the tables ``pieces`` and ``whole_all`` instead of
``visible`` and ``whole``.

``tool_calls=True`` adds ``<tool_call>``, ``</tool_call>`` (Hermes / Qwen),
``<|python_tag|>`` (Llama 3) and ``[TOOL_CALLS]`` (Mistral) the same way, in
that order, after the think tokens when both are on. A vocabulary
that has only these on top of the default keeps the default pre-tokenizer
(specials matched where a piece starts) and cuts out just these tags
first, so text without them encodes exactly as before.
"""

# baton: pure

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BOS = 256
EOS = 257
SYSTEM = 258
USER = 259
ASSISTANT = 260
END = 261

SPECIAL_TOKENS: dict[str, int] = {
    "<|bos|>": BOS,
    "<|eos|>": EOS,
    "<|system|>": SYSTEM,
    "<|user|>": USER,
    "<|assistant|>": ASSISTANT,
    "<|end|>": END,
}
FIRST_MERGE_ID = 262

# Target strings in merge-rank order. Each is reduced to one token by adding
# merges of adjacent symbols (see _build_merges), so the list reads as "what the
# vocabulary contains" rather than as raw merge pairs.
_MERGE_TARGETS: tuple[str, ...] = (
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or",
    "te", "of", "ed", "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha",
    "as", "ou", "io", "le", "ve", "co", "me", "de", "hi", "ri", "ro", "ic", "ne",
    "ea", "ra", "ce", "li", "ch", "ll", "be", "ma", "si", "om", "ur",
    " t", " a", " s", " w", " o", " i", " c", " b", " p", " m", " f", " d", " h",
    " r", " l", " n", " e", " g", " u", " y",
    "the", "ing", "and", "ion", "ent", "her", "for", "tha", "nth", "int", "ere",
    "tio", "ter", "hat", "ate", "all", "ver", "his", "ati", "are", "ith", "con",
    "res", "rea", "ons", "est", "com", "pro", "men", "ess", "ome", "oun",
    " the", " th", " an", " in", " of", " to", " and", " is", " it", " be", " as",
    " at", " on", " he", " we", " co", " re", " pro", " wh", " fo", " for",
    " that", " with", " this", " from", " have", " not", " are", " was", " you",
    " they", " his", " her", " one", " all", " can", " but", " had", " what",
    " there", " which", " their", " will", " would", " about", " when", " more",
    " time", " some", " into", " other", " than", " then", " them", " these",
    "tion", "ation", "ment", "ness", "able", "ting", "ther", "ight", "ough",
    "ence", "ance", "ould", "ever", "ally", "ical", "ions", "ings", "ated",
    " model", " token", " route", " stream", " cache", " engine", " fleet",
    "ly", "  ",
)

# Byte-level mode only, after the ASCII targets (so ASCII merge ids do not
# move). Building a whole character merges left to right, so its prefixes
# (lead byte + continuation bytes) become tokens too: "中" = E4 B8 AD brings
# b"\xe4\xb8". Leads are ones whose continuation bytes are unconstrained
# (plus F0, whose second byte must be 90..BF; see the model's tables).
BYTE_TARGETS: tuple[bytes, ...] = tuple(
    s.encode() for s in (
        "é", "è", "à", "ü", "ö", "ñ", "ç", "ß", "ø", "α", "π", "д", "и",
        "中", "文", "日", "本", "的", "是", "人", "一",
        "€", "—", "’", "“", "”", "…", "→",
        "😀", "🚀", "🎉", "👍",
    )
) + (b" \xe4", b" \xc3", b" \xe2", b" \xf0", " 中".encode(), " é".encode())

# GPT-2 style pre-tokenization: merges never cross these pieces. Special token
# strings are matched first so templates render to their ids.
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's tool-call marker (llama3_json)
TOOL_CALLS = "[TOOL_CALLS]"  # Mistral's (mistral)


_SPECIAL_RE = "|".join(re.escape(s) for s in SPECIAL_TOKENS)
_PRETOKEN_RE = re.compile(
    rf"({_SPECIAL_RE})| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"
)
_WORD_CACHE_MAX = 100_000
_REPLACEMENT = "\ufffd"


_VARIANT_STRIDE = 16


def _build_merges(
    variant: int = 0, byte_level: bool = False
) -> tuple[dict[tuple[int, int], int], list[bytes]]:
    """Turn _MERGE_TARGETS (and BYTE_TARGETS) into BPE merges (pair -> new id == rank)."""
    pieces: list[bytes] = [bytes([b]) for b in range(256)]
    pieces += [s.encode() for s in SPECIAL_TOKENS]
    merges: dict[tuple[int, int], int] = {}
    known: dict[bytes, int] = {}
    skip = variant % _VARIANT_STRIDE if variant else -1
    targets = [t.encode() for t in _MERGE_TARGETS]
    if byte_level:
        targets += BYTE_TARGETS
    for i, raw in enumerate(targets):
        if raw in known or i % _VARIANT_STRIDE == skip:
            continue
        symbols = _apply_merges(list(raw), merges)
        # Merge left to right until one symbol remains; intermediates are
        # prefixes of real fragments, so they are harmless vocabulary.
        while len(symbols) > 1:
            pair = (symbols[0], symbols[1])
            new_id = len(pieces)
            merges[pair] = new_id
            pieces.append(pieces[pair[0]] + pieces[pair[1]])
            known[pieces[new_id]] = new_id
            symbols = _apply_merges(list(raw), merges)
    return merges, pieces


def _apply_merges(symbols: list[int], merges: dict[tuple[int, int], int]) -> list[int]:
    """Classic BPE: repeatedly merge the adjacent pair with the lowest rank."""
    while len(symbols) > 1:
        best_rank = -1
        best_at = -1
        for i in range(len(symbols) - 1):
            rank = merges.get((symbols[i], symbols[i + 1]), -1)
            if rank >= 0 and (best_rank < 0 or rank < best_rank):
                best_rank, best_at = rank, i
        if best_at < 0:
            break
        symbols[best_at : best_at + 2] = [best_rank]
    return symbols


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """Immutable vocabulary plus a (mutable, bounded) per-word encode cache."""

    merges: dict[tuple[int, int], int]
    pieces: tuple[bytes, ...]
    texts: tuple[str, ...]  # decoded text of each id (specials as their names)
    _cache: dict[str, tuple[int, ...]]
    # Bytes of each id in skip_special_tokens decoding (specials -> b"").
    visible: tuple[bytes, ...] = ()
    # Text of each id when its visible bytes decode to whole characters on
    # their own ("" for specials), else None: the detokenizer's fast path.
    whole: tuple[str | None, ...] = ()
    whole_all: tuple[str | None, ...] = ()  # the same for every piece's own bytes (no skipping)
    merge_end: int = FIRST_MERGE_ID  # first id after the merges (added tokens follow)
    byte_level: bool = False
    think_start: int | None = None  # <think> / </think> ids in reasoning mode
    think_end: int | None = None
    tool_call_start: int | None = None  # <tool_call> / </tool_call> ids in tool-call mode
    tool_call_end: int | None = None
    python_tag: int | None = None  # <|python_tag|> / [TOOL_CALLS] ids in tool-call mode
    tool_calls_tag: int | None = None
    added: dict[str, int] | None = None  # strings encode() maps to one id (specials, tags)
    # New vocabularies (byte-level, reasoning) split on added tokens first; the
    # default one with tool-call tags only on the tags (see the module doc).
    _added_re: re.Pattern[str] | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str) -> list[int]:
        """Text -> ids. Special/added token strings map to their ids (like HF added tokens)."""
        if self._added_re is not None:
            # HF order: cut out added tokens first, pre-tokenize the text between.
            out: list[int] = []
            added = self.added or SPECIAL_TOKENS
            for i, part in enumerate(self._added_re.split(text)):
                if i % 2:
                    out.append(added[part])
                elif part:
                    self._encode_into(part, out)
            return out
        return self._encode_into(text, [])

    def _encode_into(self, text: str, out: list[int]) -> list[int]:
        # The default vocabulary's own pre-tokenizer (kept bit for bit): specials
        # are matched only where a piece starts, so one right after punctuation
        # ("?<|end|>") is encoded as its bytes.
        cache = self._cache
        for m in _PRETOKEN_RE.finditer(text):
            piece = m.group(0)
            special = m.group(1)
            if special is not None:
                out.append(SPECIAL_TOKENS[special])
                continue
            ids = cache.get(piece)
            if ids is None:
                ids = tuple(_apply_merges(list(piece.encode()), self.merges))
                if len(cache) >= _WORD_CACHE_MAX:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)
        return out

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Ids -> text; partial UTF-8 becomes U+FFFD."""
        pieces = self.visible if skip_special_tokens else self.pieces
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    def shown(
        self, skip_special_tokens: bool = True
    ) -> tuple[tuple[bytes, ...], tuple[str | None, ...]]:
        """Each id's bytes and whole text (or None) as a decode with this setting has them."""
        if skip_special_tokens:
            return self.visible, self.whole
        return self.pieces, self.whole_all

    def visible_bytes(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> bytes:
        """The bytes ``decode(ids, skip_special_tokens=...)`` decodes."""
        visible = self.shown(skip_special_tokens)[0]
        return b"".join(visible[i] for i in ids)

    def ends_mid_character(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> bool:
        """Whether ``decode(ids, skip_special_tokens=...)`` ends with U+FFFD.

        Looks only at the tail: a byte that is not a UTF-8 continuation byte
        always starts a new sequence, so decoding splits cleanly there.
        """
        visible, tail = self.shown(skip_special_tokens)[0], b""
        for i in reversed(ids):
            tail = visible[i] + tail
            if len(tail) >= 4:
                break
        for j in range(len(tail) - 1, -1, -1):
            if not 0x80 <= tail[j] <= 0xBF:
                return tail[j:].decode("utf-8", errors="replace").endswith(_REPLACEMENT)
        return bool(tail)  # only continuation bytes (at most 4 of them): invalid

    def vocab_hash(self) -> str:
        """``sha256:<hex>`` over every piece in id order, each length-prefixed (unambiguous)."""
        h = hashlib.sha256()
        for piece in self.pieces:
            h.update(len(piece).to_bytes(4, "big"))
            h.update(piece)
        return "sha256:" + h.hexdigest()

    def valid_ids(self, ids: Sequence[object]) -> bool:
        n = len(self.pieces)
        return all(type(i) is int and 0 <= i < n for i in ids)


def build_tokenizer(
    variant: int = 0, *, byte_level: bool = False, reasoning: bool = False,
    tool_calls: bool = False, think_special: bool = False, drop_merge: int | None = None,
) -> Tokenizer:
    merges, pieces = _build_merges(variant, byte_level)
    if drop_merge is not None:
        if drop_merge not in merges.values():
            raise ValueError(f"no merge makes token {drop_merge}")
        # The piece stays in the vocabulary; no rule makes it any more (nor any merge that
        # would take it as an input), so text that was cut into it is cut otherwise.
        merges = {pair: i for pair, i in merges.items() if i != drop_merge}
    merge_end = len(pieces)
    added = dict(SPECIAL_TOKENS)
    think_start = think_end = tool_call_start = tool_call_end = python_tag = calls_tag = None
    if reasoning:
        think_start, think_end = len(pieces), len(pieces) + 1
        pieces += [THINK_START.encode(), THINK_END.encode()]
        added |= {THINK_START: think_start, THINK_END: think_end}
    if tool_calls:
        tool_call_start, tool_call_end = len(pieces), len(pieces) + 1
        python_tag, calls_tag = len(pieces) + 2, len(pieces) + 3
        pieces += [t.encode() for t in (TOOL_CALL_START, TOOL_CALL_END, PYTHON_TAG, TOOL_CALLS)]
        added |= {TOOL_CALL_START: tool_call_start, TOOL_CALL_END: tool_call_end,
                  PYTHON_TAG: python_tag, TOOL_CALLS: calls_tag}
    # What encode() cuts out before pre-tokenizing: every added token in the new
    # vocabularies, only the tool-call tags in the default one (module doc).
    cut = added if byte_level or reasoning else {
        t: i for t, i in added.items() if t not in SPECIAL_TOKENS
    }
    texts = tuple(p.decode("utf-8", errors="replace") for p in pieces)
    special = set(range(BOS, FIRST_MERGE_ID))
    if think_special and think_start is not None and think_end is not None:
        special |= {think_start, think_end}
    visible = tuple(b"" if i in special else p for i, p in enumerate(pieces))
    whole = tuple(_whole_text(p) for p in visible)
    whole_all = tuple(_whole_text(p) for p in pieces)
    return Tokenizer(
        merges=merges, pieces=tuple(pieces), texts=texts, _cache={}, visible=visible,
        whole=whole, whole_all=whole_all, merge_end=merge_end, byte_level=byte_level,
        think_start=think_start,
        think_end=think_end, tool_call_start=tool_call_start, tool_call_end=tool_call_end,
        python_tag=python_tag, tool_calls_tag=calls_tag, added=added,
        _added_re=re.compile("(" + "|".join(re.escape(a) for a in cut) + ")") if cut else None,
    )


def _whole_text(piece: bytes) -> str | None:
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if text.endswith(_REPLACEMENT) else text
