"""The tables sim.model draws its candidates from: token ids weighted like English text
(letters, spaces, merges) and, in byte-level mode, like UTF-8 (whole characters, split
ones, invalid bytes), spread over fixed-size tables that a history hash indexes (pure).

Apart from sim.model so that the model's scoring rules stay readable on their own; the
weights decide what output looks like, the model decides which weight wins where.
"""

# baton: pure

from __future__ import annotations

from collections.abc import Sequence

from sim.tokenizer import FIRST_MERGE_ID, Tokenizer

TABLE_BITS = 12
_TABLE_SIZE = 1 << TABLE_BITS
TABLE_MASK = _TABLE_SIZE - 1

# Rough English letter frequencies (per mille) to make output look like text.
_LETTER_WEIGHTS = {
    "e": 127, "t": 91, "a": 82, "o": 75, "i": 70, "n": 67, "s": 63, "h": 61,
    "r": 60, "d": 43, "l": 40, "c": 28, "u": 28, "m": 24, "w": 24, "f": 22,
    "g": 20, "y": 20, "p": 19, "b": 15, "v": 10, "k": 8, "j": 2, "x": 2, "q": 1,
    "z": 1,
}


def weighted_table(weights: dict[int, float]) -> tuple[int, ...]:
    """Spread ids over _TABLE_SIZE slots proportionally to weight (deterministic)."""
    total = sum(weights.values())
    table: list[int] = []
    for tok, w in sorted(weights.items()):
        table.extend([tok] * max(1, round(w / total * _TABLE_SIZE)))
    while len(table) < _TABLE_SIZE:  # rounding may leave it short: wrap around
        table.extend(table[: _TABLE_SIZE - len(table)])
    table = table[:_TABLE_SIZE]
    # Scatter with an odd multiplier (a permutation mod 2^k) so that the top-1
    # and top-2 slots, read from different hash bits, are unrelated.
    return tuple(table[(i * 2654435761) % _TABLE_SIZE] for i in range(_TABLE_SIZE))


def token_weights(tok: Tokenizer) -> dict[int, float]:
    """ASCII candidates: letters, space, punctuation, digits and the ASCII merges."""
    weights: dict[int, float] = {}
    for ch, w in _LETTER_WEIGHTS.items():
        weights[ord(ch)] = float(w)
        weights[ord(ch.upper())] = w / 25
    weights[ord(" ")] = 260.0
    for ch in ",.'?!-":
        weights[ord(ch)] = 6.0
    for d in "0123456789":
        weights[ord(d)] = 1.0
    for i in range(FIRST_MERGE_ID, tok.merge_end):
        if not tok.pieces[i].isascii():
            continue  # byte-level merges: see multibyte_weights
        text = tok.texts[i]
        if text.strip():  # skip pure-whitespace merges: they only make gaps
            weights[i] = 12.0 if text.startswith(" ") else 9.0
    return weights


# Byte-level mode: share of the candidate mass at a character boundary that
# goes to multi-byte pieces, by kind (of the ASCII mass).
_WHOLE_SHARE = 0.16  # a whole character in one token ("é", "中", " é")
_LEAD_SHARE = 0.09  # a lone lead byte (C3, E4, F0, ...): 1-3 continuation bytes owed
_FRAGMENT_SHARE = 0.07  # a lead byte + some continuation bytes (E4 B8, F0 9F 98)
_LONE_CONT_SHARE = 0.035  # a lone continuation byte: invalid UTF-8
# After a lead byte / fragment: continuation bytes, else ASCII letters (invalid).
_CONT_SHARE = 0.88
_LEADS = (0xC3, 0xCE, 0xD0, 0xE2, 0xE4, 0xE6, 0xE7, 0xF0)
_LONE_CONTS = (0x80, 0x8D, 0x94, 0x9C, 0xA9, 0xAD, 0xB8, 0xBC)


def utf8_state(piece: bytes, owed: int = 0, bad: bool = False) -> tuple[int, bool]:
    """UTF-8 state after ``piece``: (continuation bytes owed, text ends in U+FFFD).

    Second-byte range rules (E0, ED, F0, F4) are ignored: the model only opens
    sequences whose continuation bytes it picks validly (see continuation_weights).
    """
    for b in piece:
        if owed:
            if 0x80 <= b <= 0xBF:
                owed -= 1
                if not owed:
                    bad = False
                continue
            bad = True  # the open sequence is cut short: U+FFFD, then b starts afresh
        if b < 0x80:
            owed, bad = 0, False
        elif 0xC2 <= b <= 0xDF:
            owed = 1
        elif 0xE0 <= b <= 0xEF:
            owed = 2
        elif 0xF0 <= b <= 0xF4:
            owed = 3
        else:
            owed, bad = 0, True  # lone continuation byte, C0, C1, F5..FF
    return owed, bad


def multibyte_weights(tok: Tokenizer, ascii_mass: float) -> dict[int, float]:
    whole: list[int] = []
    fragments: list[int] = []
    spaced: list[int] = []
    for i in range(FIRST_MERGE_ID, tok.merge_end):
        piece = tok.pieces[i]
        if piece.isascii():
            continue
        owed, bad = utf8_state(piece)
        if owed:
            (spaced if piece.startswith(b" ") else fragments).append(i)
        elif not bad:
            whole.append(i)
    weights: dict[int, float] = {}

    def spread(ids: Sequence[int], share: float) -> None:
        for i in ids:
            weights[i] = weights.get(i, 0.0) + share * ascii_mass / len(ids)

    spread(whole, _WHOLE_SHARE)
    spread(_LEADS, _LEAD_SHARE)
    spread(fragments + spaced, _FRAGMENT_SHARE)
    spread(_LONE_CONTS, _LONE_CONT_SHARE)
    return weights


def continuation_weights(owed: int) -> dict[int, float]:
    """Candidates when ``owed`` continuation bytes are still owed."""
    # After a 4-byte lead (owed 3) the next byte must be 90..BF (F0's rule);
    # 9F is the emoji block.
    conts = range(0x90, 0xC0) if owed == 3 else range(0x80, 0xC0)
    weights = {b: _CONT_SHARE / len(conts) for b in conts}
    if owed == 3:
        weights[0x9F] += _CONT_SHARE
    letters = sum(_LETTER_WEIGHTS.values())
    for ch, w in _LETTER_WEIGHTS.items():
        weights[ord(ch)] = (1 - _CONT_SHARE) * w / letters
    return weights
